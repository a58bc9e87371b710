"""Output files: written atomically, with the permissions a plain write would give them."""

import os
import stat

from fp16doctor.files import atomic_write_text


def test_a_new_file_gets_the_umask_permissions_not_the_temporary_files(tmp_path):
    target = tmp_path / "report.md"
    atomic_write_text(target, "hello")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert target.read_text() == "hello" and [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    target = tmp_path / "fixed.yaml"
    target.write_text("old")
    target.chmod(0o640)
    atomic_write_text(target, "new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 and target.read_text() == "new"


def test_the_process_umask_is_never_touched(tmp_path, monkeypatch):
    """Changing the umask races every other thread creating files (a trainer a capsule is written in)."""
    umask = os.umask(0o027)
    os.umask(umask)

    def forbidden(mask):
        raise AssertionError("os.umask called")

    monkeypatch.setattr(os, "umask", forbidden)
    new, replaced = tmp_path / "new.json", tmp_path / "replaced.json"
    replaced.write_text("old")
    replaced.chmod(0o600)
    atomic_write_text(new, "{}")
    atomic_write_text(replaced, "{}")
    monkeypatch.undo()
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(replaced.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "replaced.json"]
