"""The ``--cpu`` seam, in one place: OpenRLHF's real pipeline on a machine without a GPU.

- ``stubs``: stand-ins for ``flash_attn`` under the names upstream imports (never where the real package serves);
- ``strategy``: ``CPUDeepspeedStrategy``, upstream's DeepSpeed strategy on the CPU accelerator over gloo;
- ``engine``: upstream's ``create_vllm_engines`` / ``RolloutRayActor`` on vLLM's CPU backend, in the policy's dtype;
- ``worker``: ``CPUWorkerWrap``, upstream's vLLM worker extension receiving weights on the CPU over gloo;
- ``sync``: the gloo group of the policy -> vLLM weight sync (both ends);
- ``runtime``: ``launch_on_cpu``: Ray with logical GPUs, the flag checks, and upstream's ``train(args)``.

Nothing else in ``openrlhf_lopti.openrlhf`` knows whether it runs on CPU. Modules are imported on use:
``stubs`` must be installed before anything imports upstream's model modules.
"""
