"""The cluster's logic without Ray: scheduler, coordinator and replica as plain objects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interp_engine import InputError, parse_address, run_with_cache
from interp_engine.actors.coordinator import CoordinatorCore
from interp_engine.actors.replica import ReplicaCore, ReplicaSpec
from interp_engine.actors.scheduler import LocalExecutor, NoReplicasLeft, ReplicaDied, Scheduler, Shard
from interp_engine.errors import ClusterError, ShardFailed
from interp_engine.cluster.model import check_capacity
from interp_engine.wire import Packed, unpack_dict

POINTS = ["resid_post.1", "z.0", "mlp_post.2", "logits"]


class FakeExecutor:
    """Futures resolve when waited on, one at a time; records how many were in flight."""

    def __init__(self, fail=None):
        self.in_flight = set()
        self.max_in_flight = 0
        self.calls = []
        self.fail = fail or (lambda replica, args: None)

    def submit(self, replica, method, *args):
        future = object()
        self.in_flight.add(future)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        self.calls.append((replica, args))
        self._meta = getattr(self, "_meta", {})
        self._meta[future] = (replica, args)
        return future

    def wait(self, futures, timeout):
        return [futures[-1]]  # the newest first: results arrive out of order

    def result(self, future):
        self.in_flight.discard(future)
        replica, args = self._meta.pop(future)
        error = self.fail(replica, args)
        if error:
            raise error
        return ("done", args[0])


def test_scheduler_bounds_work_in_flight_and_pulls_shards_lazily():
    executor = FakeExecutor()
    pulled = []

    def shards():
        for i in range(50):
            pulled.append(i)
            yield Shard(i, (i,))

    results = Scheduler(executor, [0, 1, 2], per_replica=2).run("run", shards())
    first = next(results)
    assert len(pulled) <= 11  # 3 replicas x 2 in flight, one shard per replica and one looked ahead, the one yielded
    rest = list(results)
    assert sorted(s.index for s, _ in [first, *rest]) == list(range(50))
    assert executor.max_in_flight <= 6


class TimedExecutor:
    """Replicas that run their calls one after another, each call taking the replica's ``seconds``
    of simulated time. Records each moment a replica sat idle while a shard waited in another
    replica's queue (the tail that keeps replicas from dividing the time)."""

    def __init__(self, seconds: dict[int, float]):
        self.seconds, self.now = seconds, 0.0
        self.free_at = dict.fromkeys(seconds, 0.0)
        self.calls: dict[object, tuple[int, float, float, tuple]] = {}  # future -> replica, start, end, args
        self.idle_beside_queued = []

    def submit(self, replica, method, *args):
        start = max(self.now, self.free_at[replica])
        self.free_at[replica] = start + self.seconds[replica]
        future = object()
        self.calls[future] = (replica, start, self.free_at[replica], args)
        return future

    def wait(self, futures, timeout):
        idle = [r for r, t in self.free_at.items() if t <= self.now]
        queued = [f for f in futures if self.calls[f][1] > self.now]
        if idle and queued:
            self.idle_beside_queued.append((self.now, idle, len(queued)))
        first = min(futures, key=lambda f: self.calls[f][2])
        self.now = self.calls[first][2]
        return [first]

    def result(self, future):
        return ("done", self.calls.pop(future)[3][0])


@pytest.mark.parametrize("per_replica", [2, 3])
def test_the_last_shards_go_to_the_replica_that_comes_free(per_replica):
    """Two replicas, one 30 % slower: work is queued ahead on each while plenty is left, but no
    replica idles while a shard waits behind a running one, so they finish within one shard."""
    executor = TimedExecutor({0: 1.0, 1: 1.3})
    out = list(Scheduler(executor, [0, 1], per_replica=per_replica).run("run", (Shard(i, (i,)) for i in range(12))))
    assert sorted(s.index for s, _ in out) == list(range(12))
    assert executor.idle_beside_queued == []
    assert abs(executor.free_at[0] - executor.free_at[1]) <= 1.3
    assert max(executor.free_at.values()) <= 7.0  # 12 shards at 1/1.0 + 1/1.3 per unit time: 6.8 at best


def test_scheduler_moves_a_dead_replicas_shards_and_reports_each_once():
    executor = FakeExecutor(fail=lambda replica, args: ReplicaDied(replica) if replica == 1 else None)
    scheduler = Scheduler(executor, [0, 1, 2], per_replica=2)
    out = list(scheduler.run("run", (Shard(i, (i,)) for i in range(20))))
    assert sorted(s.index for s, _ in out) == list(range(20))
    assert all(result == ("done", shard.index) for shard, result in out)
    assert scheduler.dead == [1] and scheduler.resubmitted >= 1


def test_scheduler_all_replicas_dead_is_a_clear_error():
    executor = FakeExecutor(fail=lambda replica, args: ReplicaDied(replica))
    with pytest.raises(NoReplicasLeft, match="all replicas died"):
        list(Scheduler(executor, [0, 1]).run("run", (Shard(i, (i,)) for i in range(4))))


def test_scheduler_error_names_replica_and_shard():
    executor = FakeExecutor(fail=lambda replica, args: InputError("bad prompt") if args[0] == 3 else None)
    with pytest.raises(InputError, match=r"\[replica \d+ on node nodeabcd, shard 3\] bad prompt"):
        list(Scheduler(executor, [0, 1], names={0: "nodeabcdef", 1: "nodeabcdef"}).run(
            "run", (Shard(i, (i,)) for i in range(6))))


def test_packed_keeps_bfloat16_bits():
    t = torch.randn(3, 5).to(torch.bfloat16)
    assert torch.equal(Packed.of(t).tensor().view(torch.int16), t.view(torch.int16))
    assert Packed.of(t).tensor().dtype == torch.bfloat16


def test_check_capacity_refuses_what_cannot_fit():
    nodes = [{"Alive": True, "Resources": {"CPU": 2, "GPU": 1}}, {"Alive": True, "Resources": {"CPU": 2, "GPU": 1}}]
    check_capacity(nodes, 2, 1, 1)
    with pytest.raises(ClusterError, match="needs 2 GPUs on one node"):
        check_capacity(nodes, 1, 2, 1)
    with pytest.raises(ClusterError, match="at most 2 fit"):
        check_capacity(nodes, 3, 1, 0.5)
    with pytest.raises(ClusterError, match="at most 4 fit"):
        check_capacity(nodes, 5, 0, 1)


@pytest.fixture(scope="module")
def cores(tiny_path):
    spec = ReplicaSpec(str(tiny_path("llama")))
    return [ReplicaCore(spec, i) for i in range(2)]


def _cache_of(captured):
    return unpack_dict(captured.tensors)


def test_coordinator_batch_equals_local(cores, eager_models):
    local = eager_models("llama")
    tokens = local.tok.to_tokens(["The cat sat", "on", "a mat, said the dog", "x"])
    expected = run_with_cache(local, tokens, POINTS)
    core = CoordinatorCore(LocalExecutor(cores), 2, batched=True)
    got = core.run(tokens.numpy(), POINTS)
    assert np.array_equal(got.tokens, tokens.numpy())
    tensors = _cache_of(got)
    assert list(tensors) == list(expected)
    for address, tensor in expected.items():
        assert torch.equal(tensors[address], tensor), address


def test_coordinator_one_prompt_backend_splits_and_pads(cores, eager_models):
    """With ``batched=False`` each row goes alone, at its true length, and comes back padded."""
    local = eager_models("llama")
    tokens = local.tok.to_tokens(["a b c d e f", "g", "hij"])
    expected = run_with_cache(local, tokens, ["resid_post.0", "pattern.1"])
    core = CoordinatorCore(LocalExecutor(cores), 2, batched=False)
    tensors = _cache_of(core.run(tokens.numpy(), ["resid_post.0", "pattern.1"]))
    for name in ("resid_post.0", "pattern.1"):
        torch.testing.assert_close(tensors[parse_address(name)], expected[name], rtol=1e-5, atol=1e-5)


def test_coordinator_generate_survives_a_dead_replica(cores, eager_models):
    local = eager_models("llama")
    tokens = local.to_tokens("Once upon")
    completion, cache = local.capture_generation(tokens, ["resid_post.2"], max_tokens=4)
    executor = LocalExecutor(cores)
    executor.kill(0)
    got = CoordinatorCore(executor, 2, batched=True).generate(tokens.numpy(), ["resid_post.2"], {"max_tokens": 4})
    assert got.token_ids == completion.token_ids and got.text == completion.text
    assert torch.equal(_cache_of(got)[parse_address("resid_post.2")], cache["resid_post.2"])


def test_build_with_a_replica_killed_midway_equals_a_clean_build(cores, eager_models, tmp_path):
    from interp_engine.dataset.build import build_dataset

    local = eager_models("llama")
    prompts = [f"prompt {i}: " + "word " * (i % 7) for i in range(23)]
    clean = build_dataset(local, prompts, ["resid_post.1"], tmp_path / "clean", shard_size=4, progress=False)

    class Flaky(LocalExecutor):
        def submit(self, replica, method, *args):
            if method == "write_shard" and args[1] == 2:
                self.kill(1)  # replica 1 dies as shard 2 is handed out
            return super().submit(replica, method, *args)

    class FakeCluster:
        """The local model's facts with a coordinator over in-process replicas."""

        def __init__(self):
            self.info, self.capabilities, self.backend, self.tok, self.name, self.dtype = (
                local.info, local.capabilities, local.backend, local.tok, local.name, local.dtype)
            self.core = CoordinatorCore(Flaky(cores), 2, batched=True)

        def facts(self):
            return local.facts()

        def write_shards(self, spec, source, skip):
            self.core.build("b", spec, source, skip)
            yield from self.core.progress("b")

    faulty = build_dataset(FakeCluster(), prompts, ["resid_post.1"], tmp_path / "faulty", shard_size=4,
                           progress=False)
    assert faulty.rows == clean.rows == 23
    a, b = clean.to_arrow(), faulty.to_arrow()
    assert a.equals(b)
    assert sorted(b.column("prompt_index").to_pylist()) == list(range(23))


def test_coordinator_keeps_input_order_when_results_arrive_reversed(cores, eager_models):
    class Reversed(LocalExecutor):
        def wait(self, futures, timeout):
            return list(reversed(futures))[:1]

    local = eager_models("llama")
    tokens = local.tok.to_tokens(["first prompt", "2nd", "the third one", "4"])
    expected = run_with_cache(local, tokens, ["resid_post.0"])
    got = CoordinatorCore(Reversed(cores), 2, batched=False, per_replica=4).run(tokens.numpy(), ["resid_post.0"])
    assert np.array_equal(got.tokens, tokens.numpy())
    torch.testing.assert_close(_cache_of(got)[parse_address("resid_post.0")], expected["resid_post.0"],
                               rtol=1e-5, atol=1e-5)


class Recorder(LocalExecutor):
    """A LocalExecutor that records which replica each shard ran on, and can hurt chosen shards."""

    def __init__(self, replicas, hurt=None):
        super().__init__(replicas)
        self.ran: list[tuple[int, int]] = []
        self.hurt = hurt or (lambda executor, replica, index: None)

    def submit(self, replica, method, *args):
        if method == "run":
            self.hurt(self, replica, args[0])
            self.ran.append((args[0], replica))
        return super().submit(replica, method, *args)


class Echo:
    def run(self, index):
        return index

    def ping(self):
        return 0


def test_a_crashed_replica_rejoins_and_gets_work_again():
    def crash_early(executor, replica, index):
        if index == 3 and replica == 1:
            executor.crash(1)  # this call dies; Ray restarts the replica

    executor = Recorder([Echo(), Echo()], crash_early)
    scheduler = Scheduler(executor, [0, 1], per_replica=1)
    out = list(scheduler.run("run", (Shard(i, (i,)) for i in range(40))))
    assert sorted(r for _, r in out) == list(range(40))
    assert scheduler.rejoined == 1 and scheduler.dead == [] and scheduler.resubmitted == 1
    second_half = {replica for index, replica in executor.ran if index >= 20}
    assert second_half == {0, 1}  # back at full capacity


def test_a_shard_that_keeps_failing_stops_the_run_naming_it():
    def crash_on_7(executor, replica, index):
        if index == 7:
            executor.crash(replica)  # shard 7 takes down whichever replica runs it

    scheduler = Scheduler(Recorder([Echo(), Echo()], crash_on_7), [0, 1], per_replica=1,
                          names={0: "node0000aaaa", 1: "node1111bbbb"})
    with pytest.raises(ShardFailed, match=r"\[replica \d on node node\d{4}, shard 7\] shard 7 failed 3 times "
                                          r"\(on replicas \d, \d, \d\); last error: ReplicaDied"):
        list(scheduler.run("run", (Shard(i, (i,)) for i in range(20))))

    class Flaky(Echo):
        def run(self, index):
            if index == 4:
                raise OSError("store unreachable")
            return index

    with pytest.raises(ShardFailed, match=r"shard 4 failed 3 times.*OSError: store unreachable"):
        list(Scheduler(LocalExecutor([Flaky(), Flaky()]), [0, 1]).run("run", (Shard(i, (i,)) for i in range(8))))


def test_a_transient_error_is_retried():
    class Once(Echo):
        failed = False

        def run(self, index):
            if index == 2 and not Once.failed:
                Once.failed = True
                raise OSError("timeout")
            return index

    scheduler = Scheduler(LocalExecutor([Once(), Once()]), [0, 1])
    assert sorted(r for _, r in scheduler.run("run", (Shard(i, (i,)) for i in range(6)))) == list(range(6))
    assert scheduler.resubmitted == 1
