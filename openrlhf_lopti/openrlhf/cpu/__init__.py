"""The ``--cpu`` seam, in one place: OpenRLHF's real pipeline on a machine without a GPU.

- ``stubs``: stand-ins for ``vllm`` / ``flash_attn`` under the names upstream imports (never where the real
  package serves, except vLLM under ``--cpu``, whose engine is replaced);
- ``strategy``: ``CPUDeepspeedStrategy``, upstream's DeepSpeed strategy on the CPU accelerator over gloo;
- ``rollout``: ``CPURolloutActor``, Hugging Face ``generate`` behind the methods upstream calls on vLLM;
- ``runtime``: ``launch_on_cpu``: Ray with logical GPUs, the flag checks, and upstream's ``train(args)``.

Nothing else in ``openrlhf_lopti.openrlhf`` knows whether it runs on CPU. Modules are imported on use:
``stubs`` must be installed before anything imports upstream's trainer modules.
"""
