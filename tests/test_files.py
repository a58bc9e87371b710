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
