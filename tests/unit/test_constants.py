"""``_constants.Constants``: the named ints of the wire protocol and the segment layout."""

from __future__ import annotations

import pytest

from mpsched._constants import Constants
from mpsched._errors import ProtocolError
from mpsched._protocol import Tag, decode, encode

pytestmark = pytest.mark.timeout(30)


class Colour(Constants):
    RED = 1
    GREEN = 2
    _HIDDEN = 3  # not a constant: private
    label = "x"  # nor this: not an int


def test_a_constant_is_a_plain_int_with_a_name() -> None:
    assert type(Colour.RED) is int
    assert Colour.name(Colour.GREEN) == "GREEN"
    assert Colour.name(3) == "<not a Colour: 3>"


def test_check_accepts_only_the_constants() -> None:
    assert Colour.check(1) == 1
    for value in (0, 3, -1):
        with pytest.raises(ValueError, match="is not a valid Colour"):
            Colour.check(value)


def test_two_constants_cannot_share_a_value() -> None:
    with pytest.raises(TypeError, match="share a value"):

        class Twice(Constants):
            ONE = 1
            UNO = 1


def test_a_frame_with_an_unknown_tag_is_a_protocol_error() -> None:
    assert decode(encode(Tag.DRAIN, 3)) == (Tag.DRAIN, (3,))
    with pytest.raises(ProtocolError, match="is not a valid Tag"):
        decode(encode(99, 3))
