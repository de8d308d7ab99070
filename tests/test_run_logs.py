"""``tests/run_logs.py``: the first error of a failed run's output and logs, for the pipeline tests' messages."""

from pathlib import Path

from .run_logs import failure_report, first_error_in, first_errors, ray_log_files

RAY_OUTPUT = """\
2026-11-25 10:00:01,000 INFO worker.py:1 -- Connecting to existing Ray cluster at address: 127.0.0.1:6379
(LoptiPolicyModelActor pid=123) [rank0]: loading the model
(LoptiPolicyModelActor pid=123) Traceback (most recent call last):
(LoptiPolicyModelActor pid=123)   File "a.py", line 1, in <module>
""" + "".join(f'(LoptiPolicyModelActor pid=123)   File "f{i}.py", line {i}, in g\n' for i in range(30)) + """\
(LoptiPolicyModelActor pid=123) RuntimeError: the actor failed
Traceback (most recent call last):
  File "train.py", line 10, in <module>
    main()
  File "train.py", line 5, in main
    ray.get(ref)
ray.exceptions.RayTaskError(TypeError): ray::CPURolloutActor.update_weight() (pid=7)
TypeError: --cpu weight sync: the policy sent w in torch.float32, the engine runs torch.bfloat16
2026-11-25 10:00:09,000 INFO -- shutting down
""" + "noise\n" * 200


def test_a_traceback_is_given_to_its_exception_line_with_its_last_frames():
    line, excerpt = first_error_in(RAY_OUTPUT)
    assert line == 3  # the actor's traceback comes first: its header
    lines = excerpt.splitlines()
    assert lines[1].endswith("[rank0]: loading the model") and "Traceback" in lines[2]
    assert "lines of frames ..." in lines[3] and len(lines) < 20  # 31 frame lines cut to the last 12
    assert lines[-2].endswith('File "f29.py", line 29, in g')
    assert lines[-1] == "(LoptiPolicyModelActor pid=123) RuntimeError: the actor failed"


def test_the_driver_traceback_ends_at_its_exception_line():
    text = RAY_OUTPUT.split("(LoptiPolicyModelActor pid=123) Traceback")[0] + RAY_OUTPUT.split("the actor failed\n")[-1]
    _, excerpt = first_error_in(text)
    assert excerpt.splitlines()[-1].startswith("ray.exceptions.RayTaskError(TypeError)")
    assert "ray.get(ref)" in excerpt and "shutting down" not in excerpt


def test_plain_error_lines_and_none():
    assert first_error_in("usage: x\nx: error: unrecognized arguments: --bogus\n") == (
        2, "usage: x\nx: error: unrecognized arguments: --bogus")
    assert first_error_in("(raylet) [2026] ERROR node_manager.cc:1 node died\nok\n")[0] == 1
    assert first_error_in("E   assert 1 == 2\nFAILED tests/x.py::t - assert\n")[0] == 2
    assert first_error_in("Timed out waiting 60000ms for recv operation to complete\n")[0] == 1
    for quiet in ("all good\nerrors: 0\nstderr is empty\nRayTaskErrorish names\n", ""):
        assert first_error_in(quiet) is None


# torchrun's stderr when a rank raised (the frames of tests/trl_ranks.py's first DeepSpeed run, shortened)
TORCHRUN_OUTPUT = """\
  0%|          | 0/2 [00:00<?, ?it/s]/venv/torch/utils/data/dataloader.py:759: UserWarning: 'pin_memory' is set
  super().__init__(loader)
[rank1]: Traceback (most recent call last):
[rank1]:   File "tests/trl_ranks.py", line 190, in <module>
""" + "".join(f'[rank1]:   File "f{i}.py", line {i}, in g\n[rank1]:     g()\n' for i in range(40)) + """\
[rank1]: AttributeError: 'DeepSpeedZeroOptimizer' object has no attribute 'register_step_pre_hook'
[rank0]: Traceback (most recent call last):
[rank0]: AttributeError: 'DeepSpeedZeroOptimizer' object has no attribute 'register_step_pre_hook'
E1128 10:10:26.944000 20376 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0
"""


def test_a_ranks_traceback_under_torchrun_ends_at_its_exception_line():
    """torchrun puts ``[rankN]: `` before each line of a rank's traceback (before: the excerpt ended at a frame)."""
    _, excerpt = first_error_in(TORCHRUN_OUTPUT)
    lines = excerpt.splitlines()
    assert lines[2] == "[rank1]: Traceback (most recent call last):" and "lines of frames ..." in lines[3]
    assert lines[-1] == "[rank1]: AttributeError: 'DeepSpeedZeroOptimizer' object has no attribute " \
                        "'register_step_pre_hook'"  # fmt: skip


def test_sources_are_labelled_files_are_read_and_the_report_has_the_tail(tmp_path):
    log = tmp_path / "worker.err"
    log.write_text("start\nValueError: bad value\n")
    report = first_errors("nothing here", log, ("job output", "RuntimeError: boom"), tmp_path / "missing.log")
    assert report.splitlines()[0] == f"--- first error in {log}, line 2:"
    assert "--- first error in job output, line 1:\nRuntimeError: boom" in report
    assert first_errors("fine", most=1) == ""
    message = failure_report("fine\n" * 10 + "the end", log, tail=7)
    assert message.startswith(f"--- first error in {log}") and message.endswith("the end")


def test_ray_log_files_lists_each_session_once_most_telling_first(tmp_path):
    logs = tmp_path / "session_2026-11-25_10-00-00_1" / "logs"
    logs.mkdir(parents=True)
    for name in ("raylet.out", "worker-abc-01000000-7.err", "job-driver-raysubmit_1.log", "gcs_server.out"):
        (logs / name).write_text("x")
    (tmp_path / "session_latest").symlink_to(logs.parent)
    names = [p.name for p in ray_log_files(tmp_path)]
    assert names == ["job-driver-raysubmit_1.log", "worker-abc-01000000-7.err", "raylet.out", "gcs_server.out"]
    assert ray_log_files(Path(tmp_path / "absent")) == []


# What a Ray job's driver prints when an actor's call failed (the shape of the multi-node job's output with an error
# planted in the reward function): the driver's traceback ends in a RayTaskError line, then Ray appends the remote
# traceback, itself a chain, whose last line is the cause.
RAY_TASK_ERROR = """\
(LoptiPPOTrainer pid=4613) Generate samples:  50%|#####     | 2/4
Traceback (most recent call last):
  File "train_ppo_ray.py", line 9, in train
    ray.get(ppo_trainer.fit.remote())
Generate samples: 100%|##########| 4/4
  File "ray/_private/worker.py", line 1023, in get_objects
    raise value.as_instanceof_cause()
ray.exceptions.RayTaskError(ValueError): ray::LoptiPPOTrainer.fit() (pid=4613, ip=192.0.2.2)
  File "ppo_trainer.py", line 230, in fit
    self.experience_maker.make_experience()
  File "experience_maker.py", line 88, in rewards
    return ray.get(refs)
ray.exceptions.RayTaskError(ValueError): ray::reward_fn() (pid=4700, ip=192.0.2.2)
  File "reward.py", line 3, in reward_func
    raise ValueError("planted: the reward function failed")
ValueError: planted: the reward function failed

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "x.py", line 1, in <module>
RuntimeError: the reward could not be computed
2026-11-25 10:00:09,000 INFO -- shutting down
Traceback (most recent call last):
  File "other.py", line 1, in <module>
KeyError: 'later, elsewhere'
"""


def test_a_remote_ray_traceback_is_followed_to_its_cause_and_its_chain():
    line, excerpt = first_error_in(RAY_TASK_ERROR, context=0)
    lines = excerpt.splitlines()
    assert line == 2 and lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: the reward could not be computed"  # the chain's last exception
    assert "ValueError: planted: the reward function failed" in lines  # the remote cause
    assert "KeyError" not in excerpt and "shutting down" not in excerpt  # a later traceback is another error
    long = RAY_TASK_ERROR.replace('  File "experience_maker.py"', '  File "f.py", line 1, in g\n' * 20 + '  File "experience_maker.py"')
    lines = first_error_in(long, context=0)[1].splitlines()
    assert any("lines of frames ..." in x for x in lines) and len(lines) < 25
    assert lines[-1] == "RuntimeError: the reward could not be computed"
    # the exception lines of the frames cut are kept, in order
    assert [x for x in lines if x.startswith("ray.exceptions")][0].startswith("ray.exceptions.RayTaskError(ValueError): ray::LoptiPPOTrainer.fit()")


def test_the_same_error_in_two_sources_is_given_once(tmp_path):
    log = tmp_path / "job-driver-raysubmit_1.log"
    log.write_text(RAY_TASK_ERROR)
    report = first_errors(("job output", RAY_TASK_ERROR), log, ("worker.err", "KeyError: '/psm_1'\n"))
    assert report.count("--- first error in") == 2 and str(log) not in report


def test_rays_real_remote_traceback_and_resource_tracker_noise():
    # Ray 2.55's format: the RayTaskError line, then the remote frames with their caret lines, then the cause
    text = """\
Traceback (most recent call last):
  File "train.py", line 9, in train
    ray.get(ppo_trainer.fit.remote())
ray.exceptions.RayTaskError(ValueError): \x1b[36mray::LoptiPPOTrainer.fit()\x1b[39m (pid=7391, ip=192.0.2.2)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "experience_maker.py", line 142, in make_experience
    raise ValueError("reward_model_group is required when rewards are not precomputed")
ValueError: reward_model_group is required when rewards are not precomputed
\x1b[36m(LoptiPPOTrainer pid=7391)\x1b[0m Episode [1/1]:   0%|          | 0/8
"""
    assert first_error_in(text)[1].splitlines()[-1] == "ValueError: reward_model_group is required when rewards are not precomputed"
    worker_err = """\
/usr/lib/python3.11/multiprocessing/resource_tracker.py:123: UserWarning: resource_tracker: process died unexpectedly
Traceback (most recent call last):
  File "/usr/lib/python3.11/multiprocessing/resource_tracker.py", line 239, in main
    cache[rtype].remove(name)
KeyError: '/psm_ff9d1d02'
Traceback (most recent call last):
  File "worker.py", line 5, in update_weight
TypeError: --cpu weight sync: the policy sent w in torch.float32, the engine runs torch.bfloat16
"""
    line, excerpt = first_error_in(worker_err, context=0)
    assert line == 6 and excerpt.splitlines()[-1].startswith("TypeError: --cpu weight sync")
