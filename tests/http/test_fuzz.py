"""Random bodies against the app (in process, on asyncio and trio): never a 500, always a
JSON body, and no weight changes from anything but a valid update."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from lifecycle.http import create_app, demo_generate

pytestmark = pytest.mark.anyio

FIELDS = ["model_path", "target_modules", "flush_cache", "serialized_named_tensors",
          "load_format", "module_names", "seed", "steps", "tags", "weight_version",
          "payload_gpu_uuids", "weight_update_mode", "lora_alpha", "lora_rank", "target_module",
          "expected_named_tensors_sha256", "names", "dtypes", "shapes", "group_name", "timeout"]
PATHS = ["/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk",
         "/update_weights_from_tensor", "/get_weights_checksum", "/generate", "/flush_cache",
         "/update_weights_from_tensor_checker", "/init_weights_update_group",
         "/update_weights_from_distributed", "/destroy_weights_update_group"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4),
    json_values.map(lambda v: v),
    st.binary(max_size=64))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), body=bodies)
async def test_random_bodies_never_crash_the_app_or_change_weights(path: str, body: Any) -> None:
    """Whatever a client sends to any POST path: a JSON answer under 500, the server keeps
    serving, and the weights are unchanged (only a valid update may change them)."""
    pipe = DemoPipeline.build(2**16)
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        before = ctl.weights_checksum()
        app = create_app(ctl, generate=demo_generate(pipe))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await client.post(path, content=content,
                                  headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, body, r.text)
            assert isinstance(r.json(), dict)
            health = await client.get("/health")
            assert health.status_code == 200
        assert ctl.weights_checksum() == before
