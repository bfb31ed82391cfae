"""supervisor.agent.hpack against another HPACK implementation: the `hpack` package
(python-hyper's, the one the `h2` stack uses) encodes, ours decodes, and the
other way round; its Huffman table and static table are compared entry by entry."""

from __future__ import annotations

import hpack
import pytest
from hpack import huffman_constants
from hpack.huffman import HuffmanEncoder
from hpack.table import HeaderTable
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.agent.hpack import (
    HUFFMAN,
    STATIC_TABLE,
    Decoder,
    HpackError,
    encode_headers,
    huffman_decode,
)

NAMES = st.sampled_from(
    ["grpc-status", "grpc-message", "content-type", ":status", "x-a", "date", "server"]
)
VALUES = st.text(st.characters(codec="utf-8", exclude_characters="\r\n\x00"), max_size=40)
BLOCKS = st.lists(
    st.lists(st.tuples(NAMES, VALUES), min_size=1, max_size=8), min_size=1, max_size=6
)


def test_the_huffman_code_is_rfc_7541s_code_for_code() -> None:
    for symbol in range(257):
        code, length = HUFFMAN[symbol]
        assert length == huffman_constants.REQUEST_CODES_LENGTH[symbol], symbol
        assert code == huffman_constants.REQUEST_CODES[symbol], symbol


def test_the_static_table_is_rfc_7541s() -> None:
    assert [(n.decode(), v.decode()) for n, v in HeaderTable.STATIC_TABLE] == list(STATIC_TABLE)


@given(st.binary(max_size=200))
def test_huffman_strings_decode_to_what_was_coded(data: bytes) -> None:
    coder = HuffmanEncoder(huffman_constants.REQUEST_CODES, huffman_constants.REQUEST_CODES_LENGTH)
    assert huffman_decode(coder.encode(data)) == data


def test_bad_huffman_padding_and_indices_are_refused() -> None:
    with pytest.raises(HpackError, match="padding"):
        huffman_decode(b"\x00")  # '0' (00000) then 000: padding must be ones
    with pytest.raises(HpackError, match="past the dynamic table"):
        Decoder().decode(bytes([0x80 | 62]))


@settings(max_examples=150, deadline=None)
@given(BLOCKS, st.booleans(), st.sampled_from([4096, 256, 0]))
def test_blocks_from_another_encoder_decode_with_one_dynamic_table(
    blocks: list[list[tuple[str, str]]], huffman: bool, table_size: int
) -> None:
    """Indexed entries, literals with and without indexing, Huffman or not, and a
    table size update: one decoder across the blocks, as on one connection."""
    encoder = hpack.Encoder()
    encoder.header_table_size = table_size
    decoder = Decoder()
    for block in blocks:
        assert decoder.decode(encoder.encode(block, huffman=huffman)) == block


@given(st.lists(st.tuples(NAMES, VALUES), max_size=10))
def test_our_literals_decode_with_another_decoder(headers: list[tuple[str, str]]) -> None:
    got = hpack.Decoder().decode(encode_headers(headers))
    assert [(n, v) for n, v in got] == headers
