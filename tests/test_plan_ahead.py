"""The length index (read once, no images) and the plan-ahead data wrapper."""
import json
import time

import numpy as np
import pytest
from PIL import Image

from hcp.data.code_corpus import CodeCorpus
from hcp.data.llava import IGNORE_INDEX, LlavaDataset
from hcp.data.loader import GlobalBatchSampler
from hcp.data.tokenizer import ByteTokenizer
from hcp.plan.ahead import PlanAhead, use_worker
from hcp.plan.lengths import build_length_index
from plan_ahead_workers import FlagPlanner, ImportsPlanner, busy, busy_planner, pid_planner
from hcp.config.specs import resolve_modules
from cfg_utils import with_specs

TOK = ByteTokenizer()


def test_length_index_of_llava_data_matches_the_samples(tmp_path):
    Image.new("L", (4, 4)).save(tmp_path / "a.png")
    conv = lambda q: [{"from": "human", "value": q}, {"from": "gpt", "value": "seven"}]  # noqa: E731
    recs = [{"id": "one", "image": "a.png", "conversations": conv("<image>\nWhat?")},
            {"id": "two", "image": ["a.png", "a.png"], "conversations": conv("<image><image> and?")},
            {"id": "none", "conversations": conv("Hi?")}]
    (tmp_path / "d.json").write_text(json.dumps(recs))
    ds = LlavaDataset(str(tmp_path / "d.json"), str(tmp_path), TOK, 4, 8, 1, 200)
    index = build_length_index(ds, TOK.image_token_id, 4)
    for i, s in enumerate(ds.samples):
        assert index.tokens[i] == len(s.input_ids)
        assert index.loss_tokens[i] == sum(lab != IGNORE_INDEX for lab in s.labels)
    assert index.images.tolist() == [1, 2, 0] and index.image_rows.tolist() == [4, 8, 0]
    # sample 1's two adjacent images start where their runs of 4 placeholders do
    pos = np.flatnonzero(np.array(ds[1].input_ids) == TOK.image_token_id)
    assert index.take([1]).image_starts.tolist() == [pos[0], pos[4]] and pos[4] == pos[0] + 4
    batch = index.take([2, 1])
    assert batch.tokens.tolist() == [len(ds[2].input_ids), len(ds[1].input_ids)]
    assert batch.image_offsets.tolist() == [0, 0, 2] and batch.image_rows.tolist() == [0, 8]


def test_length_index_of_the_code_corpus_needs_no_sample_reads(tmp_path):
    for name, n in (("a.py", 10), ("b.py", 37)):
        (tmp_path / name).write_text("x" * n)
    ds = CodeCorpus(sorted(str(p) for p in tmp_path.glob("*.py")), str(tmp_path), TOK, 16, False, 0.0)
    index = build_length_index(ds, TOK.image_token_id, 0)
    assert index.tokens.tolist() == [len(ds[i].input_ids) for i in range(len(ds))]
    assert index.loss_tokens.tolist() == [sum(lab != IGNORE_INDEX for lab in ds[i].labels)
                                          for i in range(len(ds))]
    assert index.image_rows.sum() == 0


def test_plan_ahead_hides_the_next_plan_behind_the_step_and_follows_the_sampler():
    """The step's work waits until the next plan is done (an event, not a sleep, so a loaded
    machine cannot reorder them): that plan is then hidden but for the hand-over, and the
    first one, with nothing to hide behind, barely (its job starts just before `next` waits)."""
    import threading

    sampler = GlobalBatchSampler(40, 4, seed=0)
    planned = [threading.Event() for _ in range(8)]  # the k-th prepare call has finished
    calls = []

    def prepare(indices):
        calls.append(indices)
        time.sleep(0.2)
        planned[len(calls) - 1].set()
        return sum(indices)

    ahead = PlanAhead(sampler, prepare)
    try:
        stats = []
        for k in range(3):
            indices, out, st = ahead.next()
            assert indices == sampler.batch(k) and out == sum(indices) and sampler.position == k + 1
            stats.append(st)
            assert planned[k + 1].wait(timeout=60)           # the step's work outlasts the next
        assert stats[0]["plan_s"] >= 0.2 and stats[0]["plan_hidden_s"] < 0.5 * stats[0]["plan_s"]
        assert all(s["plan_s"] >= 0.2 and s["plan_hidden_s"] > 0.5 * s["plan_s"] for s in stats[1:])
        sampler.load_state_dict({"position": 7})            # resume elsewhere: replanned
        indices, _, _ = ahead.next()
        assert indices == sampler.batch(7)
    finally:
        ahead.close()


def test_plan_ahead_raises_the_planning_error_at_the_step_that_needs_it():
    sampler = GlobalBatchSampler(8, 4, seed=0)

    def prepare(indices):
        raise ValueError("bad plan")

    ahead = PlanAhead(sampler, prepare)
    with pytest.raises(ValueError, match="bad plan"):
        ahead.next()
    ahead.close()


def test_length_index_of_blended_token_data_matches_the_samples(tmp_path):
    import json as _json

    from cfg_utils import compose_cfg
    from hcp.data.build import build_datasets
    from hcp.data.indexed import write_indexed

    rng = np.random.default_rng(0)
    write_indexed(str(tmp_path / "small"), [rng.integers(0, 256, rng.integers(2, 40)) for _ in range(20)])
    with open(tmp_path / "big.jsonl", "w") as f:
        for _ in range(30):
            f.write(_json.dumps({"text": "x" * int(rng.integers(3, 90))}) + "\n")
    sources = (f"data.sources=[{{path: {tmp_path / 'small'}, weight: 0.6}}, "
               f"{{path: {tmp_path / 'big.jsonl'}, weight: 0.4}}]")
    cfg = compose_cfg(["+recipe=llama_tiny", "data=tokens", "data.max_seq_len=32", sources])
    _, train, _ = build_datasets(*with_specs(cfg))
    index = build_length_index(train, -1, 0)
    assert index.tokens.tolist() == [len(train[i].input_ids) for i in range(len(train))]
    assert index.loss_tokens.tolist() == [sum(lab != IGNORE_INDEX for lab in train[i].labels)
                                          for i in range(len(train))]


def test_planner_runs_in_a_worker_process_and_prepare_gets_its_plan():
    import os
    sampler = GlobalBatchSampler(40, 4, seed=0)
    ahead = PlanAhead(sampler, lambda indices, plan: (plan, list(indices)), pid_planner)
    try:
        for k in range(2):
            indices, ((pid, total), seen), st = ahead.next()
            assert pid != os.getpid() and total == sum(indices)
            assert seen == indices == sampler.batch(k)
            assert st["plan_cpu_s"] >= 0
    finally:
        ahead.close()


def _gil_taken_by_planning(planner_in_process: bool) -> float:
    """CPU seconds the other threads of this process ran while the main thread did 1.5 CPU
    seconds of pure-Python work with the next plan (1 CPU second of pure Python) in flight.
    Pure Python runs one thread at a time (the GIL), so that is how long planning kept the
    main thread from running; unlike wall time, it does not count other processes' load."""
    sampler = GlobalBatchSampler(40, 4, seed=0)
    ahead = (PlanAhead(sampler, lambda indices, plan: plan, busy_planner) if planner_in_process
             else PlanAhead(sampler, busy_planner))
    try:
        ahead.next()  # the worker is up; the next plan starts now
        cpu, own = time.process_time(), time.thread_time()
        busy(1.5)
        return (time.process_time() - cpu) - (time.thread_time() - own)
    finally:
        ahead.close()


def test_planning_in_a_worker_process_does_not_stall_a_busy_main_thread():
    """Issue 24: a planner on a thread holds the GIL in turns with the training thread (here
    ~1 s of the main thread's time goes to it); in a worker process, none."""
    thread, process = _gil_taken_by_planning(False), _gil_taken_by_planning(True)
    print(f"GIL time taken from a busy main thread: planning on a thread {thread:.3f} s, "
          f"in a worker process {process:.3f} s")
    assert thread > 0.5 and process < 0.05


def test_dynamic_cp_step_planner_plans_the_same_in_a_worker_process(tmp_path):
    """The trainer's planner (`hcp.train.planner.StepPlanner`) pickles with the run's packing,
    module specs and length index, registers the dynamic-CP policy in the fresh worker, and plans
    there what it plans in this process (the plan's checksum), without importing torch there
    (issue 24: the worker's start)."""
    from cfg_utils import compose_cfg, long_tail_corpus
    from hcp.config.layouts import resolve_layouts
    from hcp.config.settings import PackingSpec
    from hcp.data.build import build_datasets
    from hcp.train.encoders import LengthIndexes
    from hcp.train.planner import StepPlanner

    cfg = compose_cfg(["+recipe=llama_tiny", "packing=dynamic_cp", "trainer.global_batch_size=16",
                       "data.max_seq_len=512", "trainer.micro_batch_tokens=128",
                       "launcher.nproc_per_node=4", f"data.path={long_tail_corpus(tmp_path)}"])
    tok, train, _ = build_datasets(*with_specs(cfg))
    specs = resolve_modules(cfg, resolve_layouts(cfg, 4))
    planner = StepPlanner(PackingSpec.of(cfg), specs, LengthIndexes(specs, train, tok))
    sampler = GlobalBatchSampler(len(train), 16, seed=0)
    ahead = PlanAhead(sampler, lambda indices, plan: plan, ImportsPlanner(planner))
    try:
        indices, (step, torch_in_worker), _ = ahead.next()
    finally:
        ahead.close()
    here = planner(indices)
    assert step.checksum() == here.checksum() and step.packing.num_rounds > 0
    assert not torch_in_worker


def test_the_worker_starts_with_the_wrapper_not_at_the_first_plan(tmp_path):
    """Issue 24: the worker is spawned and its planner installed (its imports done) while the
    caller sets up, so the first step does not wait for them. No `next()` is called here."""
    flag = tmp_path / "installed"
    ahead = PlanAhead(GlobalBatchSampler(40, 4, seed=0), lambda i, plan: plan,
                      FlagPlanner(str(flag)))
    try:
        deadline = time.monotonic() + 120  # generous: spawning on a loaded machine
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert flag.exists()
        assert ahead.next()[1] == sum(ahead.sampler.batch(0))
    finally:
        ahead.close()


def test_the_worker_is_the_default_on_gpu_ranks_only():
    assert use_worker(None, "cuda") and not use_worker(None, "cpu")
    assert use_worker(True, "cpu") and not use_worker(False, "cuda")
