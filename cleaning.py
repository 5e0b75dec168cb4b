"""The paper's cleaning of raw text (its released text8-style cleaner, with dynpool's
fixes), on its own so that sample.py cleans a prompt without importing the downloader.

    clean("Café Müller, 1990!", "en")  ->  "caf m ller one nine nine zero"

Per piece of text, in the paper's order: wiki40b markers -> line breaks; then per
character: homoglyph -> ASCII (Unicode's confusables; not for Hebrew, whose letters look
like l, o, v), lower case, each digit spelled as its own word, anything outside the
language's alphabet -> a space; whitespace collapsed, empty lines dropped. Fixes where
the paper's pipeline is broken: NFC first (a + U+0308 is ä), İ -> i, Hebrew digit words
without niqqud."""
import functools
import re
import unicodedata
from collections import Counter

_AZ = 'abcdefghijklmnopqrstuvwxyz'
_VI_VOWELS = 'aăâeêioôơuưy'
_VI_TONES = '\u0300\u0301\u0309\u0303\u0323'  # grave, acute, hook, tilde, dot below

# Per language: the alphabet (token ids follow '\n' and ' ' in this order), the digit
# names, and the paper's settings that go into meta.json "defaults" for train.py: the
# Unigram vocabulary size of the boundary labels and the Gumbel prior alpha. Alphabets
# and digit names are the paper's.
LANGS = {
    'en': dict(letters=_AZ, unigram=10000, prior=0.2,
               digits='zero one two three four five six seven eight nine'),
    'fi': dict(letters=_AZ + 'åäö', unigram=200, prior=0.37,
               digits='nolla yksi kaksi kolme neljä viisi kuusi seitsemän kahdeksan yhdeksän'),
    # 27 letters (finals included), then maqaf, geresh, gershayim (as in צה״ל)
    'he': dict(letters=''.join(chr(c) for c in range(0x5D0, 0x5EB)) + '\u05be\u05f3\u05f4',
               unigram=200, prior=0.2, digits='אפס אחד שנים שלשה ארבעה חמשה ששה שבעה שמונה תשעה'),
    # no f, j, w, z; the tone-marked vowels precomposed (NFC)
    'vi': dict(letters='abcdeghiklmnopqrstuvxy' + 'ăâđêôơư' + ''.join(
        unicodedata.normalize('NFC', v + t) for v in _VI_VOWELS for t in _VI_TONES),
               unigram=10000, prior=0.2, digits='không một hai ba bốn năm sáu bảy tám chín'),
}
TEXT8_ALPHABET = [' '] + list(_AZ)   # text8 is already clean: space and a-z, no newline

MARKERS = re.compile(r'_START_(?:ARTICLE|SECTION|PARAGRAPH)_|_NEWLINE_')   # wiki40b's


@functools.cache
def homoglyphs():
    """{character: ASCII} from Unicode's confusables (UTS #39, package
    confusable-homoglyphs): each non-ASCII character confusable with one ASCII character
    (or with ASCII punctuation only, as “ with ''), plus the fullwidth forms U+FF01-FF5E
    through their NFKC form."""
    # pinned in requirements.txt: its data decides
    from confusable_homoglyphs import confusables
    # the data lists confusables both ways; right-to-left ones wrapped in U+200E
    listed = {}
    found = {}
    for key, protos in confusables.confusables_data.items():
        key = key.strip('\u200e')
        if len(key) != 1:
            continue
        for p in (h['c'].strip('\u200e') for h in protos):
            if not key.isascii() and p.isascii() and (
                    len(p) == 1 or not any(ch.isalnum() for ch in p)):
                found.setdefault(key, p)  # the character's own prototype first
            elif key.isascii() and len(p) == 1 and not p.isascii():
                listed.setdefault(p, key)
    # a character's own prototype before one listed the other way
    found = listed | found
    for cp in range(0xFF01, 0xFF5F):
        a = unicodedata.normalize('NFKC', chr(cp))
        found.setdefault(chr(cp), found.get(a, a))
    return found


class _CharMap(dict):
    """str.translate table of one language, filled lazily: each code point is decided
    once. Per character, in the paper's order: homoglyph -> lower case -> digit ->
    alphabet."""

    def __init__(self, lang):
        words = LANGS[lang]['digits'].split()
        # what a lower-case character becomes: itself (a letter), its digit's word; else a space
        self.kept = {c: c for c in LANGS[lang]['letters'] + '\n'}
        self.kept.update((str(d), f' {w} ') for d, w in enumerate(words))
        self.homoglyphs = homoglyphs() if lang != 'he' else {}

    def __missing__(self, cp):
        c = chr(cp)
        # a letter or digit is itself (no homoglyph is ASCII, as the digits are)
        if c not in self.kept:
            c = self.homoglyphs.get(c, c)
        # fix: Python lower-cases İ to i + U+0307, whose dot would split the word
        lowered = 'i' if c == 'İ' else c.lower()
        self[cp] = ''.join(self.kept.get(ch, ' ') for ch in lowered)
        return self[cp]


# the language's _CharMap, made once
_table = functools.cache(_CharMap)


def clean(text: str, lang: str) -> str:
    """The paper's cleaning of raw text with dynpool's fixes → alphabet letters, single
    spaces and newlines, no empty lines or spaces at line ends; clean(clean(x)) ==
    clean(x)."""
    table = _table(lang)
    text = MARKERS.sub('\n', text)
    # fix: decomposed (NFD) input composed first, so ä = a + U+0308 stays one letter (text
    # already NFC, as most is, passes normalize's quick check unchanged)
    text = unicodedata.normalize('NFC', text)
    text = text.translate(table)
    lines = (' '.join(line.split()) for line in text.split('\n'))
    return '\n'.join(line for line in lines if line)


def _keeps(lang, letter):
    """Whether cleaning for lang keeps `letter` as a letter (not a space)."""
    return bool(_table(lang)[ord(letter)].strip())


def foreign_letters(text, lang):
    """Why raw `text` looks like another language or script than lang, in words (most of its
    letters are ones that cleaning for lang turns into spaces: their share, their script,
    and the first --lang that keeps most of them), or None."""
    letters = Counter(c for c in text if c.isalpha())
    lost = Counter({c: n for c, n in letters.items() if not _keeps(lang, c)})
    if 2 * lost.total() <= letters.total():
        return None
    scripts = Counter()
    for c, n in lost.items():   # a letter's Unicode name starts with its script
        scripts[unicodedata.name(c, '?').split()[0].title()] += n
    why = (f'{lost.total() / letters.total():.0%} of its letters are not in the --lang {lang} '
           f'alphabet, most of them {scripts.most_common(1)[0][0]}: text in another language or '
           'script?')
    for other in LANGS:
        kept = sum(n for c, n in lost.items() if _keeps(other, c))
        if 2 * kept > lost.total():
            return f'{why} --lang {other} keeps them'
    return why
