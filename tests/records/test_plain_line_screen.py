"""The fast-path screen of a JSON Lines record (kvbench.records.schema.read.plain_line) in one
translate and a few searches: it must send to the careful path every line the screen of
eleven searches sent there (a 3-digit exponent, a 21-digit integer, NaN or Infinity, a space
before a colon, deep nesting). Checked against that screen, written out here, on lines made
of the tokens that matter, and on the cases by name."""

from __future__ import annotations

import random

import pytest

from kvbench.records.schema.read import MAX_DEPTH, MAX_INT_DIGITS, plain_line

_DIGITS = bytes.maketrans(b"123456789E", b"000000000e")
_SUSPECTS = (b"0" * (MAX_INT_DIGITS + 1), b"e000", b"e+000", b"e-000")


def reference(raw: bytes) -> bool:
    """The screen as it was (eleven searches), the standard the faster one is held to."""
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH or b"NaN" in raw or b"Infinity" in raw:
        return False
    if b'" :' in raw or b'"\t:' in raw or b'"\r:' in raw:
        return False
    b = raw.translate(_DIGITS)
    if _SUSPECTS[0] in b:
        return False
    return not (any(p in b for p in _SUSPECTS[1:]) and _exponent(b))


def _exponent(b: bytes) -> bool:
    for pat in _SUSPECTS[1:]:
        i = b.find(pat)
        while i >= 0:
            j = i - 1
            while j >= 0 and b[j] in b"0.":
                j -= 1
            if j < i - 1:
                if j >= 0 and b[j] == 45:
                    j -= 1
                while j >= 0 and b[j] in b" \t\r\n":
                    j -= 1
                if j < 0 or b[j] in b":[,":
                    return True
            i = b.find(pat, i + 1)
    return False


TOKENS = [b'"a"', b'"node-000"', b'"91e013fad477"', b'"x+100"', b"1e100", b"-1e100", b"1E+100",
          b"2.5e-300", b"-0.5E-100", b"1e10", b"12", b"-7", b"3.25", b"1" * 21, b"1" * 20,
          b"NaN", b"Infinity", b"-Infinity", b":", b",", b"[", b"]", b"{", b"}", b" ", b"\t",
          b"\r", b'"k"', b'"k" :', b'"k"\t:', b'"k"\r:', b'"k":', b"e", b"E", b"+", b"-",
          b"000", b".", b"0", b"ee000", b"e-000", b"e+000"]


def test_the_screen_sends_every_line_the_old_one_sent_to_the_careful_path():
    rng = random.Random(20261207)
    fast_both = careful_both = only_now = 0
    for _ in range(60_000):
        raw = b"".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 12)))
        old, new = reference(raw), plain_line(raw)
        assert not (new and not old), raw  # never a line the old screen sent to the careful path
        fast_both += old and new
        careful_both += not old and not new
        only_now += old and not new
    # the screen is not merely refusing everything: most lines agree both ways
    assert fast_both > 5_000 and careful_both > 5_000 and only_now < (fast_both + careful_both) / 10


@pytest.mark.parametrize("raw", [
    b'{"x":1e100}', b'{"x": -1E+100}', b'{"x":[2.5e-300]}', b'{"x":\t-0.5e-100}', b'{"x":NaN}',
    b'{"x":Infinity}', b'{"x" :1}', b'{"x"\t:1}', b'{"x"\r:1}', b'{"x":' + b"1" * 21 + b"}",
    b"[" * (MAX_DEPTH + 1)])
def test_what_needs_the_careful_path_takes_it(raw):
    assert not plain_line(raw) and not reference(raw)


@pytest.mark.parametrize("raw", [
    b'{"host":"node-000","x":1e10}', b'{"id":"91e013fad477"}', b'{"x":-1e-10,"y":[1,2,3]}',
    b'{"x":' + b"1" * 20 + b"}", b'{"name":"a+000"}'])
def test_ordinary_lines_take_the_fast_path(raw):
    assert plain_line(raw) and reference(raw)
