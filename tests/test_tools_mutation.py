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
