"""files.atomic: a write leaves the old file or the new one, whole, and never follows a planted link."""

import os

import pytest

from conftest import dead_pid
from llm_trainer.errors import UsageError
from llm_trainer.files import atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "record.json"
    atomic.write_file(path, b"old")

    def failing(handle):
        handle.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic.write_file(path, failing)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
    with pytest.raises(
        UsageError, match=r"could not update .*missing-folder.x \(write failed: .*\); the file is as it was"
    ):
        atomic.write_bytes(tmp_path / "missing-folder" / "x", b"new")


def test_a_symlink_at_the_path_is_replaced_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("theirs")
    (tmp_path / "ours").symlink_to(target)
    atomic.write_text(tmp_path / "ours", "mine")
    assert target.read_text() == "theirs"
    assert not (tmp_path / "ours").is_symlink() and (tmp_path / "ours").read_text() == "mine"


def test_a_folder_is_swapped_in_whole(tmp_path):
    final = tmp_path / "folder"
    final.mkdir()
    (final / "a").write_text("old")
    tmp = atomic.temporary_folder(final)
    tmp.mkdir()
    (tmp / "b").write_text("new")
    atomic.move_into_place(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    assert atomic.remove_folder(final) and not any(tmp_path.iterdir())


def test_leftovers_of_a_dead_writer_are_told_from_live_ones(tmp_path):
    host, child = atomic.owner().rsplit("-", 1)[0], dead_pid()
    assert atomic.dead_writer(f".x.tmp-1-{host}-{child}")
    assert not atomic.dead_writer(f".x.tmp-1-{host}-{os.getppid()}")  # alive
    assert not atomic.dead_writer(f".x.tmp-1-{atomic.owner()}")  # this process
    assert not atomic.dead_writer(f".x.tmp-1-otherhost-{child}")  # another machine's: not ours to judge


def test_the_folder_versions_names_are_read_back_as_written(tmp_path):
    final = tmp_path / "best-model.v2"  # dashes and dots in the folder's own name
    host = atomic.owner().rsplit("-", 1)[0]
    assert atomic.folder_version(atomic.temporary_folder(final).name) == ("tmp", "best-model.v2", atomic.owner())
    assert atomic.folder_version(atomic.temporary_folder(final, f"{host}-7").name) == (
        "tmp",
        "best-model.v2",
        f"{host}-7",
    )
    assert atomic.folder_version(atomic.parked_folder(final).name) == ("old", "best-model.v2", atomic.owner())
    for other in (".tmp-x", ".old-x-host", ".del-x-host-pid", ".new-x-host-1", "tmp-x-host-1", ".tmp--host-1"):
        assert atomic.folder_version(other) is None, other
    assert atomic.folder_version(atomic.temporary_file(final).name) is None  # a file's, not a folder's


def test_only_dead_writers_temporary_files_are_removed(tmp_path):
    host, dead = atomic.owner().rsplit("-", 1)[0], dead_pid()
    names = {
        f".model.gguf.tmp-1-{host}-{dead}": False,  # a dead writer's: removed
        f".other.bin.tmp-1-{host}-{dead}": True,  # a dead writer's, of another file: kept when `of` is given
        f".model.gguf.tmp-1-{host}-{os.getppid()}": True,  # a live writer's
        f".model.gguf.tmp-1-otherhost-{dead}": True,  # another machine's
        ".model.gguf.tmp-notes": True,  # not a name we give
    }
    for name in names:
        (tmp_path / name).write_bytes(b"partial")
    atomic.remove_dead_temporary_files(tmp_path, of="model.gguf")
    assert {p.name for p in tmp_path.iterdir()} == {name for name, kept in names.items() if kept}
    atomic.remove_dead_temporary_files(tmp_path)
    assert f".other.bin.tmp-1-{host}-{dead}" not in {p.name for p in tmp_path.iterdir()}
