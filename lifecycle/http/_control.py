"""The RL clients' control routes beyond release, resume and updates (see docs/service.md's
wire table for each route's reference):

* **vLLM's sleep**: ``POST /sleep?level=1|2&mode=abort|wait|keep`` (level 2 discards the
  weights: no host copy), ``POST /wake_up?tags=...``, ``GET /is_sleeping`` (per component too).
* **Generation control** (lifecycle.http._generations): SGLang's ``/pause_generation``
  ``{"mode": "abort"|"in_place"|"retract"}``, ``/continue_generation`` and ``/abort_request``
  ``{"rid", "abort_all"}``; vLLM's ``/pause?mode=abort|wait|keep&clear_cache=``, ``/resume``,
  ``GET /is_paused`` and ``/abort_requests`` ``{"request_ids"}``.
* **Versions and checks**: ``/update_weight_version`` ``{"new_version",
  "abort_all_requests"}``, SGLang's ``/weights_checker`` ``{"action": "snapshot"|
  "reset_tensors"|"compare"}``, vLLM's ``/weight_checker {"action": "checksum"|"reset"|
  "compare", "baseline"}``, ``GET /get_world_size``.

Bodies are checked like every other route's (unknown fields ignored); refusals are 4xx and
change nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .._select import resolve_tags
from ._answers import Routes, transition
from ._bodies import field, json_body, refused
from ._generations import ABORT_MODES
from ._state import Service, service_of

__all__ = ["CONTROL_ROUTES"]

_SGLANG_MODES = ["abort", "retract", "in_place"]
_VLLM_MODES = ["abort", "wait", "keep"]


def components_of(service: Service, tags: Any) -> list[str] | None:
    """The components ``tags`` name (see lifecycle._select), None for the whole pipeline; a
    400 naming what is valid."""
    if tags is None:
        return None
    names = resolve_tags(tags, list(service.ctl.components))
    everyone = set(service.ctl.components)
    return None if names == everyone else sorted(names)


def _query_tags(request: Request) -> list[str] | None:
    tags = request.query_params.getlist("tags")
    return tags or None


# -- vLLM's sleep ---------------------------------------------------------------------------
async def sleep(request: Request) -> Response:
    """``POST /sleep?level=1|2&mode=abort|wait|keep``: level 1 keeps a host copy, level 2
    discards the weights (update them after the wake); mode ``abort`` ends the generations
    in flight first, ``wait`` / ``keep`` let them finish (the release drains them)."""
    service = service_of(request)
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise refused(f"level must be 1 (weights kept on the host) or 2 (weights discarded), "
                      f"got {level[:20]!r}")
    mode = request.query_params.get("mode", "abort")
    if mode not in _VLLM_MODES:
        raise refused(f"mode must be one of {_VLLM_MODES}, got {mode[:20]!r}")
    components = components_of(service, _query_tags(request))
    if mode in ABORT_MODES:
        service.generations.abort(None, "the server was put to sleep")
    return await transition(request, lambda body: service.driver.sleep(
        level == "2", components))


async def wake_up(request: Request) -> Response:
    """``POST /wake_up?tags=...``: the components the tags name (none: all)."""
    service = service_of(request)
    components = components_of(service, _query_tags(request))
    return await transition(request, lambda body: service.driver.wake(components))


async def is_sleeping(request: Request) -> Response:
    """``GET /is_sleeping``: sleeping only while every component is asleep; which are."""
    ctl = service_of(request).ctl
    return JSONResponse({"is_sleeping": ctl.phase.value == "sleeping",
                         "components": {n: n in ctl.asleep for n in ctl.components}})


# -- generation control -----------------------------------------------------------------------
async def _pause(service: Service, mode: str) -> int:
    return await service.generations.pause(mode)


async def pause_generation(request: Request) -> Response:
    """SGLang's ``/pause_generation {"mode"}`` (default ``abort``)."""
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    mode = body.get("mode", "abort")
    if mode not in _SGLANG_MODES:
        shown = repr(mode)[:60]
        raise refused(f"Invalid mode: {shown}. Expected one of {_SGLANG_MODES}.")
    aborted = await _pause(service, mode)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok",
                         "mode": mode, "aborted": aborted})


async def continue_generation(request: Request) -> Response:
    service = service_of(request)
    await json_body(request, service.body_limit)
    service.generations.resume()
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


async def pause(request: Request) -> Response:
    """vLLM's ``/pause?mode=abort|wait|keep&clear_cache=`` (``wait_for_inflight_requests=true``:
    the deprecated spelling of ``wait``); ``clear_cache`` gives cached device blocks back."""
    service = service_of(request)
    await json_body(request, service.body_limit)
    mode = request.query_params.get("mode", "abort")
    if mode not in _VLLM_MODES:
        return JSONResponse({"error": f"mode must be one of {_VLLM_MODES}, got {mode[:20]!r}"},
                            status_code=400)
    flags = {}
    for name in ("clear_cache", "wait_for_inflight_requests"):
        value = request.query_params.get(name, "true" if name == "clear_cache" else "false")
        if value.lower() not in ("true", "false", "1", "0"):
            return JSONResponse({"error": f"{name} must be true or false, got {value[:20]!r}"},
                                status_code=400)
        flags[name] = value.lower() in ("true", "1")
    if flags["wait_for_inflight_requests"] and mode == "abort":
        mode = "wait"
    await _pause(service, mode)
    if flags["clear_cache"] and mode != "keep":
        await service.ctl.device_layer.release_cache()
    return JSONResponse({"status": "paused"})


async def resume_generation(request: Request) -> Response:
    service = service_of(request)
    await json_body(request, service.body_limit)
    service.generations.resume()
    return JSONResponse({"status": "resumed"})


async def is_paused(request: Request) -> Response:
    generations = service_of(request).generations
    return JSONResponse({"is_paused": generations.paused, "mode": generations.mode,
                         "in_flight": len(generations.in_flight)})


async def abort_request(request: Request) -> Response:
    """SGLang's ``/abort_request {"rid", "abort_all"}``: one generation by id, or all."""
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    rid = field(body, "rid", "string", default="")
    everything = field(body, "abort_all", "boolean", default=False)
    if not rid and not everything:
        return JSONResponse({"success": True, "aborted": 0})
    aborted = service.generations.abort(None if everything else rid, "aborted by /abort_request")
    return JSONResponse({"success": True, "aborted": aborted})


async def abort_requests(request: Request) -> Response:
    """vLLM's ``/abort_requests {"request_ids"}``: those (none or empty: every one)."""
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    ids: Sequence[str] | None = field(body, "request_ids", "list of strings")
    why = "aborted by /abort_requests"
    if ids:
        aborted = sum(service.generations.abort(rid, why) for rid in dict.fromkeys(ids))
    else:
        aborted = service.generations.abort(None, why)
    return JSONResponse({"status": "aborted", "aborted": aborted})


# -- versions and checks ------------------------------------------------------------------------
async def update_weight_version(request: Request) -> Response:
    """``/update_weight_version {"new_version", "abort_all_requests"}`` (default true, the
    reference's): names the weights served; nothing moves."""
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    version = field(body, "new_version", "string", required=True)
    if service.ctl.phase.value == "uninitialized":
        raise refused("pipeline not initialized", 503)
    if field(body, "abort_all_requests", "boolean", default=True):
        service.generations.abort(None, f"the weight version changed to {version[:80]!r}")
    await service.driver.set_weight_version(version)
    return JSONResponse({"success": True, "message": f"Weight version updated to {version}",
                         "new_version": version})


_CHECKER_ACTIONS = ("snapshot", "reset_tensors", "compare")


async def weights_checker(request: Request) -> Response:
    """SGLang's ``/weights_checker {"action"}``: ``snapshot`` hashes every tensor,
    ``reset_tensors`` writes random values into every one (one update, all or nothing),
    ``compare`` names every tensor that differs from the snapshot."""
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    action = body.get("action")
    if action not in _CHECKER_ACTIONS:
        raise refused(f"Unsupported action={str(action)[:40]!r}; expected one of "
                      f"{list(_CHECKER_ACTIONS)}")
    success, message = await service.driver.weights_checker(action)
    return JSONResponse({"success": success, "message": message},
                        status_code=200 if success else 400)


async def weight_checker(request: Request) -> Response:
    """vLLM's ``/weight_checker {"action": "checksum"|"reset"|"compare", "baseline"}``: the
    caller keeps the baseline (``{"module.tensor": sha256}``, from ``checksum``); an engine
    paused or (partly) asleep is a 409, as vLLM's."""
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    action = body.get("action")
    if action not in ("checksum", "reset", "compare"):
        message = f"action must be one of checksum|reset|compare, got {str(action)[:40]!r}"
        raise refused(message, detail=message)
    ctl = service.ctl
    if service.generations.paused or ctl.asleep or ctl.phase.value != "awake":
        message = "weight_checker requires an awake, unpaused engine"
        raise refused(message, 409, detail=message)
    baseline = body.get("baseline")
    if action == "compare" and not isinstance(baseline, dict):
        message = "action='compare' requires a 'baseline' object"
        raise refused(message, detail=message)
    if action == "reset":
        success, message = await service.driver.weights_checker("reset_tensors")
        if not success:
            raise refused(message)
        return JSONResponse({"status": "reset"})
    hashes = await ctl.tensor_hashes()
    checksums = {f"{c}.{n}": h for c, named in hashes.items() for n, h in named.items()}
    if action == "checksum":
        return JSONResponse({"checksums": checksums})
    assert isinstance(baseline, dict)
    mismatches = sorted({n for n, h in baseline.items() if checksums.get(str(n)) != h}
                        | (checksums.keys() - {str(n) for n in baseline}))
    return JSONResponse({"match": not mismatches, "mismatches": mismatches})


async def get_world_size(request: Request) -> Response:
    """vLLM's ``GET /get_world_size`` (``include_dp`` accepted: there is no data parallelism
    here, so both answers are the ranks that serve)."""
    return JSONResponse({"world_size": service_of(request).driver.world_size})


CONTROL_ROUTES: Routes = {
    "/sleep": (sleep, ("POST",), True), "/wake_up": (wake_up, ("POST",), True),
    "/is_sleeping": (is_sleeping, ("GET",), True),
    "/pause_generation": (pause_generation, ("POST",), True),
    "/continue_generation": (continue_generation, ("POST",), True),
    "/pause": (pause, ("POST",), True), "/resume": (resume_generation, ("POST",), True),
    "/is_paused": (is_paused, ("GET",), True),
    "/abort_request": (abort_request, ("POST",), True),
    "/abort_requests": (abort_requests, ("POST",), True),
    "/update_weight_version": (update_weight_version, ("POST",), True),
    "/weights_checker": (weights_checker, ("POST",), True),
    "/weight_checker": (weight_checker, ("POST",), True),
    "/get_world_size": (get_world_size, ("GET",), True),
}
