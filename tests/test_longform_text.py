"""`read_text_file`: the encodings a long-form text file may come in, and one clear line for the rest (no export)."""

from __future__ import annotations

import codecs

import pytest

from higgs_onnx.longform.files import read_text_file

TEXT = "Caf\u00e9 cr\u00e8me, na\u00efve \u2014 \u201cquoted\u201d. \u4f60\u597d\u3002 \U0001f600 End.\n"


@pytest.mark.parametrize("data", [
    TEXT.encode("utf-8"), codecs.BOM_UTF8 + TEXT.encode("utf-8"),
    TEXT.encode("utf-16"), codecs.BOM_UTF16_LE + TEXT.encode("utf-16-le"), codecs.BOM_UTF16_BE + TEXT.encode(
        "utf-16-be"),
    TEXT.encode("utf-32"), codecs.BOM_UTF32_LE + TEXT.encode("utf-32-le"), codecs.BOM_UTF32_BE + TEXT.encode(
        "utf-32-be"),
], ids=["utf-8", "utf-8-bom", "utf-16", "utf-16-le-bom", "utf-16-be-bom", "utf-32", "utf-32-le-bom",
        "utf-32-be-bom"])
def test_unicode_encodings_with_a_byte_order_mark(tmp_path, data):
    path = tmp_path / "t.txt"
    path.write_bytes(data)
    assert read_text_file(path) == TEXT  # the mark itself is not part of the text


@pytest.mark.parametrize("data, message", [
    (b"", "is empty"),
    (b"  \n\n ", "is empty"),
    (codecs.BOM_UTF16_LE + "  \n".encode("utf-16-le"), "is empty"),
    (b"\x00\x01binary\x00", "is a binary file, not text"),
    (bytes(range(256)) * 4, "is a binary file, not text"),
    ("caf\u00e9 cr\u00e8me".encode("latin-1"),
     "is not UTF-8 text (byte 3: b'\\xe9'); convert it, e.g. iconv -f latin1"),
    ("Plain words here.".encode("utf-16-le"), "looks like UTF-16LE text without a byte-order mark; convert it, e.g. "
                                              "iconv -f UTF-16LE -t UTF-8"),
    ("Plain words here.".encode("utf-16-be"), "looks like UTF-16BE text"),
    (codecs.BOM_UTF16_LE + b"A\x00\x00\xd8", "starts with a UTF-16 byte-order mark but is not valid UTF-16 text"),
    (codecs.BOM_UTF16_LE + "a\x00b".encode("utf-16-le"), "is a binary file"),
], ids=["empty", "blank", "blank-utf16", "binary", "all-bytes", "latin-1", "utf16le-no-bom", "utf16be-no-bom",
        "bad-utf16", "nul-in-utf16"])
def test_refused_in_one_line(tmp_path, data, message):
    path = tmp_path / "t.txt"
    path.write_bytes(data)
    with pytest.raises(ValueError) as e:
        read_text_file(path)
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_not_a_file(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a folder"):
        read_text_file(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text_file(tmp_path / "none.txt")
