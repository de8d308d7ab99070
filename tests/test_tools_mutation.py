"""``tools/mutation.py``'s rewrite of decorated functions, which lets mutmut mutate them."""

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from mutation import undecorate  # noqa: E402

SOURCE = '''
import torch
from contextlib import contextmanager


class Holder:
    @contextmanager
    def opened(self, log):
        log.append("enter")
        try:
            yield len(log)
        finally:
            log.append("exit")

    @torch.no_grad()
    def doubled(self, x):
        return (x * 2).requires_grad


@staticmethod
def untouched():
    return 1
'''


def test_undecorate_writes_the_decorator_as_an_assignment_and_changes_nothing_else():
    rewritten = undecorate(SOURCE)
    assert "@contextmanager" not in rewritten and "@torch.no_grad()" not in rewritten
    assert "    opened = contextmanager(opened)\n" in rewritten
    assert "    doubled = torch.no_grad()(doubled)\n" in rewritten
    assert "@staticmethod\ndef untouched" in rewritten  # other decorators stay
    for source in (SOURCE, rewritten):  # same behaviour before and after
        namespace = {}
        exec(compile(source, "<test>", "exec"), namespace)
        holder, log = namespace["Holder"](), []
        with holder.opened(log) as inside:
            assert inside == 1 and log == ["enter"]
        assert log == ["enter", "exit"]
        assert holder.doubled(torch.ones(2, requires_grad=True)) is False


def test_the_trainers_four_decorated_methods_are_rewritten():
    source = (REPO / "openrlhf_lopti" / "openrlhf" / "trainer.py").read_text()
    rewritten = undecorate(source)
    compile(rewritten, "trainer.py", "exec")
    for name, decorator in (
        ("_direction_metrics", "torch.no_grad()"),
        ("_passes_end_on_optimizer_steps", "contextmanager"),
        ("_replay_items_in_phase", "contextmanager"),
        ("_fused_policy_loss", "contextmanager"),
    ):
        assert f"    {name} = {decorator}({name})\n" in rewritten
    assert undecorate(rewritten) == rewritten


def test_an_out_holding_the_users_files_is_refused_before_anything_is_removed(tmp_path, capsys):
    """``--out DIR`` ran rmtree on DIR/tree and DIR/<module> without asking (a user's DIR/tree was lost)."""
    import pytest

    import mutation

    out = tmp_path / "mine"
    (out / "tree").mkdir(parents=True)
    (out / "tree" / "notes.txt").write_text("mine")
    (out / "plan.md").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        mutation.main(["--out", str(out), "--only", next(iter(mutation.MODULES))])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mutation.py: error: --out {out}: holds files this tool did not write (plan.md); a run "
                   "replaces its tree/ and <module>/ folders: choose a new or empty folder"]  # fmt: skip
    assert (out / "tree" / "notes.txt").read_text() == "mine"
    assert mutation.out_problem(tmp_path / "new", REPO) == ""  # a new folder, or the tool's own, is taken
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / mutation.MARKER).write_text("")
    assert mutation.out_problem(tmp_path / "own", REPO) == ""
    assert "holds --tree" in mutation.out_problem(tmp_path, tmp_path / "tree")


def test_gpu_install_check_parse_of_a_bad_report_is_one_line(tmp_path, capsys):
    """``--parse`` of a missing file, non-JSON, {} or [] were tracebacks."""
    import pytest

    import gpu_install_check

    cases = {"missing.json": None, "text.json": "not json", "empty.json": "{}", "list.json": "[]",
             "entries.json": '{"version": "1", "install": [1]}'}  # fmt: skip
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit) as exit_:
            gpu_install_check.main(["--parse", str(path)])
        assert exit_.value.code == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"gpu_install_check.py: error: --parse {path}: "), err
