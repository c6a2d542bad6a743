"""The vLLM backend's engine loop (its typed messages, held and exclusive work, routing phases) over a fake engine:
the order that keeps every token of a sample on one weights version, without starting vLLM."""

from concurrent import futures
from types import SimpleNamespace

from cisjax.engines.vllm import backend as vb
from cisjax.engines.vllm import routing_capture
from cisjax.engines.vllm import work as vllm_work


class FakeLLM:
    """What the loop calls of `vllm.LLM`: requests finish at the first step, each with two tokens."""

    def __init__(self):
        self.running, self.rpcs = [], []
        self.llm_engine = self

    def add_request(self, rid, prompt, sp):
        self.running.append(rid)
        return f"internal-{rid}"

    def step(self):
        done, self.running = self.running, []
        return [SimpleNamespace(request_id=r, finished=True, outputs=[SimpleNamespace(token_ids=[5, 6])]) for r in done]

    def abort_request(self, rids, internal):
        self.running = [r for r in self.running if r not in rids]

    def has_unfinished_requests(self):
        return bool(self.running)

    def reset_prefix_cache(self):
        return True

    def collective_rpc(self, fn, args=()):
        self.rpcs.append((fn, args))
        if fn is routing_capture.read:
            return [[f"rows of {rid}" for rid, _ in args[0]]]
        return [0]


def _backend():
    b = vb.Backend.__new__(vb.Backend)  # no engine started: the loop's methods over FakeLLM
    b.llm, b.version = FakeLLM(), 3
    return b


def _call(name, order, routing=False):
    def finish(call, outs):
        order.append(name)
        return (call.version, call.captured, [o.request_id for o in outs])

    return vllm_work.Call([(name, {"prompt_token_ids": [1, 2, 3]}, None)], finish, futures.Future(), routing)


def test_a_reload_waits_for_the_calls_in_flight_and_holds_back_new_ones():
    b, work, order = _backend(), vllm_work.Work(), []
    first, later = _call("first", order), _call("later", order)

    def reload():
        order.append("reload")
        b.version = 4

    swap = vllm_work.Exclusive(reload, futures.Future())
    b._receive(first, work)
    b._receive(swap, work)
    b._receive(later, work)
    assert list(work.admitted) == ["first"] and list(work.exclusive) == [swap] and list(work.held) == [later]
    for _ in range(3):
        b._advance(work)
    assert order == ["first", "reload", "later"] and work.idle()
    assert first.future.result() == (3, [], ["first"]) and later.future.result() == (4, [], ["later"])
    assert swap.future.done() and swap.future.exception() is None


def test_routing_calls_run_in_a_phase_of_their_own():
    b, work, order = _backend(), vllm_work.Work(), []
    routed, plain = _call("routed", order, routing=True), _call("plain", order)
    b._receive(routed, work)
    assert list(work.exclusive) == [routed]
    b._advance(work)  # the phase starts (capture on), the routing call runs
    assert order == ["routed"] and work.phase  # it ends at the next turn, the engine idle
    assert routed.future.result() == (3, ["rows of internal-routed"], ["routed"])
    assert (routing_capture.install, (True,)) in b.llm.rpcs
    b._receive(plain, work)  # a phase may still run: held until it ends
    b._advance(work)
    b._advance(work)
    assert order == ["routed", "plain"] and (routing_capture.install, (False,)) in b.llm.rpcs and work.idle()


def test_a_routing_call_joins_the_phase_running():
    b, work, order = _backend(), vllm_work.Work(phase=True), []
    joining = _call("joining", order, routing=True)
    b._receive(joining, work)
    assert list(work.admitted) == ["joining"]
    held = _call("held", order)
    b._receive(held, work)
    assert list(work.held) == [held]


def test_cancel_and_stop():
    b, work, order = _backend(), vllm_work.Work(), []
    running, waiting = _call("running", order), _call("waiting", order)
    b._receive(running, work)
    b._receive(vllm_work.Exclusive(lambda: None, futures.Future()), work)
    b._receive(waiting, work)
    b._receive(vllm_work.Cancel(waiting.future), work)
    assert not work.held and waiting.future.cancelled()
    b._receive(vllm_work.Cancel(running.future), work)
    assert not work.admitted and not b.llm.running  # aborted in the engine (its future already runs)
    pending = _call("pending", order)
    b._receive(pending, work)
    b._fail([*work.admitted.values(), *work.held, *work.exclusive], RuntimeError("the server is shutting down"))
    assert "shutting down" in str(pending.future.exception()) and "shutting down" in str(
        work.exclusive[0].future.exception()
    )


def test_streamed_weights_dirs_are_removed_when_replaced_and_when_the_backend_goes(tmp_path):
    """The temp dir a tensor stream was written to (load_tensors) is the backend's: removed when another replaces it,
    and when the backend goes without close() (a finalizer; also run at the interpreter's exit), not left behind."""
    import gc

    b = _backend()
    b.platform, b._owned_dir, b._owned_cleanup = "cpu", None, None
    b._reload = lambda llm, path: None  # the engine's in-place reload: nothing to do here
    first, second, plain = (tmp_path / name for name in ("first", "second", "plain"))
    for d in (first, second, plain):
        d.mkdir()
    b._swap(first, 4, owned=True)
    b._swap(second, 5, owned=True)
    assert not first.exists() and second.exists() and b.weights_dir == second and b.version == 5
    b._swap(second, 6, owned=True)  # the same dir again: kept, one hook for it
    assert second.exists()
    del b
    gc.collect()
    assert not second.exists()
    kept = _backend()
    kept.platform, kept._owned_dir, kept._owned_cleanup = "cpu", None, None
    kept._reload = lambda llm, path: None
    kept._swap(plain, 7, owned=False)  # a directory the caller gave (update_weights): never removed
    del kept
    gc.collect()
    assert plain.exists()
