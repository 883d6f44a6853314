"""vllm_harness.py: the set-up test_vllm.py, test_vllm_hma.py and test_vllm_mamba.py share: the
module-level skip where vLLM is not importable, the connector's settings for a test daemon, vLLM's
config built from them, and the worker's calls of one forward with the waits a test makes around
them (saves settled, blocks handed back, a load with the daemon killed). The per-test daemon,
``vd``, is conftest.py's. Imported by the test modules after their own vLLM imports succeeded,
so vLLM is imported here inside the functions."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Dict, NoReturn, Optional

import pytest

from conftest import BUILD_ROOT, Daemon


def skip_without_vllm(e: BaseException) -> NoReturn:
    """Skips the calling test module, saying why vLLM did not import and where its install
    log is."""
    pytest.skip("vllm is not importable (%s: %s); scripts/engines/vllm.sh installs it, its log "
                "is %s" % (type(e).__name__, e,
                           os.path.join(BUILD_ROOT, "pyenv", "engine-vllm.log")),
                allow_module_level=True)


def extra_config(d: Daemon, model: str, /, **extra: Any) -> Dict[str, Any]:
    """The connector's kv_connector_extra_config for daemon ``d``: long deadlines (a test's
    daemon is not the thing timed) and a fast reconnect probe; ``extra`` adds or overrides
    (``model`` too)."""
    ec: Dict[str, Any] = {"unix_path": d.unix, "model": model, "scheduler_deadline_ms": 2000,
                          "worker_deadline_ms": 2000, "probe_ms": 20}
    ec.update(extra)
    return ec


def transfer_config(d: Daemon, model: str, /, **extra: Any) -> Any:
    """vLLM's KVTransferConfig naming the connector by module path, as `--kv-transfer-config`
    does, with extra_config's settings."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
                            kv_role="kv_both",
                            kv_connector_extra_config=extra_config(d, model, **extra))


def vllm_config(d: Daemon, model: str, block_size: int, /, tp: int = 1, **extra: Any) -> Any:
    """vLLM's config with the connector on daemon ``d`` (transfer_config), on the CPU, pages of
    ``block_size`` tokens, ``tp`` tensor-parallel ranks."""
    from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, VllmConfig

    return VllmConfig(kv_transfer_config=transfer_config(d, model, **extra),
                      device_config=DeviceConfig(device="cpu"),
                      cache_config=CacheConfig(block_size=block_size),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp))


def settle(worker: Any, timeout: float) -> None:
    """Waits until the worker's save jobs are stored (or dropped) and its loads' leases are
    released, so that another engine's lookup finds the saves."""
    deadline = time.monotonic() + timeout
    while not (worker.saves_in_flight() == 0 and all(f.done() for _, f in worker._io_futures)):
        assert time.monotonic() < deadline, "saves never settled"
        time.sleep(0.005)


def forward(worker: Any, kvc: Dict[str, Any], meta: Any) -> set:
    """The worker's calls in one forward, as vLLM's model runner and attention layers make
    them (every layer of ``kvc`` loaded, then saved). Returns the blocks reported as failed to
    load."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name, t in kvc.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, t, None)
    worker.wait_for_save()
    assert worker.get_finished(set()) == (None, None)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return errors


def handed_back(worker: Any, request_id: str) -> None:
    """The worker's get_finished calls of the steps after a request finished with its blocks
    held (a save was planned), until it hands them back: the request is reported once, as done
    sending."""
    finished = {request_id}
    deadline = time.monotonic() + 5
    while True:
        sending, _ = worker.get_finished(finished)
        finished = set()
        if sending:
            assert sending == {request_id}
            return
        assert time.monotonic() < deadline, "the blocks were never handed back"
        time.sleep(0.002)


def load_with_daemon_killed(d: Daemon, worker: Any, meta: Any, timeout: float) -> Any:
    """A step's loads between steps (``meta``, planned after a hit) with the daemon SIGKILLed
    first: the worker's calls until it reports the load, never a block among its load errors.
    Returns that get_transfer_results."""
    d.stop(signal.SIGKILL)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    deadline = time.monotonic() + timeout
    while True:
        worker.wait_for_save()
        res = worker.get_transfer_results(set())
        assert worker.get_block_ids_with_load_errors() == set()
        if res.finished_recving:
            break
        assert time.monotonic() < deadline, "the load was never reported"
        time.sleep(0.005)
    worker.clear_connector_metadata()
    return res


def real_scheduler(model_config: Any, d: Daemon, model: str, kvc: Any, policy: str,
                   /, extra: Optional[Dict[str, Any]] = None, **cache: Any) -> Any:
    """vLLM's own v1 Scheduler for the KV cache config ``kvc`` (its KV cache manager that
    config's coordinator), with the connector named by its module path on daemon ``d``, in
    ``model``'s namespace, its settings ``extra`` added (transfer_config), and vLLM's
    ``kv_load_failure_policy`` ``policy``; ``cache`` sets CacheConfig's fields (by default
    vLLM's prefix cache off, so that every request asks the connector). Returns it and its
    config."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    import kvtier.vllm as kv

    ktc = transfer_config(d, model, **(extra or {}))
    ktc.kv_load_failure_policy = policy
    block_size = kvc.kv_cache_groups[0].kv_cache_spec.block_size
    cache = {"enable_prefix_caching": False, **cache}
    cfg = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                     cache_config=CacheConfig(block_size=block_size, **cache),
                     kv_transfer_config=ktc)
    cfg.cache_config.num_gpu_blocks = kvc.num_blocks
    s = Scheduler(vllm_config=cfg, kv_cache_config=kvc,
                  structured_output_manager=StructuredOutputManager(cfg), block_size=block_size)
    assert isinstance(s.connector, kv.KvtierConnector)
    return s, cfg


def run_step(s: Any, worker: Any, kvs: Dict[str, Any], layers: Any, out: Any,
             reported: Dict[str, set]) -> None:
    """vLLM's model runner's part of step ``out`` of vLLM's Scheduler ``s``: the worker's
    forward with the step's metadata (the ``layers`` of ``kvs`` whose attention calls the
    per-layer hooks waiting for their load and saving; Mamba layers call none), its
    KVConnectorOutput as the model runner builds it (get_transfer_results, then
    get_block_ids_with_load_errors), handed to update_from_output with the step's requests
    (their tokens computed, none sampled). ``reported`` collects the
    requests reported failed ("failed") and loaded ("recving"), and the failed blocks
    ("invalid"), step after step."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    worker.bind_connector_metadata(out.kv_connector_metadata)
    worker.start_load_kv(None)
    for name in layers:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, kvs[name], None)
    worker.wait_for_save()
    res = worker.get_transfer_results(out.finished_req_ids)
    invalid = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    for what, got in (("failed", res.failed_recving), ("recving", res.finished_recving),
                      ("invalid", invalid)):
        assert not reported.setdefault(what, set()) & set(got), "reported twice: %s" % what
        reported[what] |= set(got)
    ids = list(out.num_scheduled_tokens)  # the step's requests, none sampling a token
    s.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[[] for _ in ids], kv_connector_output=KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving, invalid_block_ids=invalid)))
