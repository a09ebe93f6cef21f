"""Strict constructors (unknown keywords are refused, by name) and verl's spellings keep working:
``@ray.remote`` worker classes, ``RayResourcePool`` keywords, ``device_name``."""

from __future__ import annotations

import os

import pytest
import ray

from controlplane import (
    ClassWithInitArgs,
    Dispatch,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    WorkerGroup,
    register,
)


class Plain(Worker):
    def __init__(self, x: int, y: int = 1) -> None:
        super().__init__()
        self.x, self.y = x, y

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def values(self) -> tuple:
        return self.rank, self.x, self.y, os.environ.get("FROM_DECORATOR"), os.environ.get("FROM_OPTIONS")


class Open:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


@ray.remote
class Decorated(Worker):
    """verl's tests define workers like this."""

    def __init__(self, x: int) -> None:
        super().__init__()
        self.x = x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def plus(self, y: int) -> int:
        return self.x + y + self.rank


@ray.remote(num_cpus=0.2, max_concurrency=2, runtime_env={"env_vars": {"FROM_DECORATOR": "yes"}})
class DecoratedWithOptions(Plain):
    pass


# ---- pure --------------------------------------------------------------------------------------
def test_class_spec_refuses_what_the_constructor_cannot_take() -> None:
    with pytest.raises(
        TypeError,
        match=r"Plain.__init__\(x, y=1\) got unexpected keyword "
        r"argument\(s\) \['z'\]",
    ):
        RayClassWithInitArgs(Plain, 1, z=2)
    with pytest.raises(TypeError, match=r"\['yy'\] \(did you mean 'y'\?\)"):
        ClassWithInitArgs(Plain, x=1, yy=2)
    with pytest.raises(TypeError, match="too many positional arguments"):
        RayClassWithInitArgs(Plain, 1, 2, 3)
    with pytest.raises(TypeError, match="multiple values for argument 'x'"):
        RayClassWithInitArgs(ray.remote(Plain), 1, x=2)
    assert RayClassWithInitArgs(Open, anything=1).kwargs == {"anything": 1}  # **kwargs: all accepted
    assert RayClassWithInitArgs(Plain).args == ()  # missing arguments are the caller's business


def test_actor_options_are_checked_by_name() -> None:
    spec = RayClassWithInitArgs(Plain, 1)
    with pytest.raises(TypeError, match=r"\['max_concurency'\] \(did you mean 'max_concurrency'\?\)"):
        spec.update_options({"max_concurency": 2})
    with pytest.raises(TypeError, match="nme"):
        spec.actor_options(None, use_gpu=False, options={"nme": "a"})
    spec.update_options({"max_concurrency": 2})
    assert spec.actor_options(None, use_gpu=False)["max_concurrency"] == 2


def test_device_name_picks_the_accelerator_resource() -> None:
    spec = RayClassWithInitArgs(Plain, 1)
    assert spec.actor_options(None, use_gpu=True, num_gpus=0.5)["num_gpus"] == 0.5
    npu = spec.actor_options(None, use_gpu=True, num_gpus=0.5, device_name="npu")
    assert npu["resources"] == {"NPU": 0.5} and "num_gpus" not in npu
    assert "num_gpus" not in spec.actor_options(None, use_gpu=True, device_name="cpu")
    with pytest.raises(ValueError, match=r"unknown device_name 'tpu'; known: \['cpu', 'cuda', 'npu'\]"):
        spec.actor_options(None, use_gpu=True, device_name="tpu")
    assert RayResourcePool([2], use_gpu=True).bundle_spec() == {"CPU": 10.0, "GPU": 1.0}
    assert RayResourcePool([2], use_gpu=True, device_name="npu").bundle_spec() == {"CPU": 10.0, "NPU": 1.0}
    assert RayResourcePool([2], use_gpu=True).bundle_spec("npu") == {"CPU": 10.0, "NPU": 1.0}
    assert RayResourcePool([2], use_gpu=True).bundle_spec("cpu") == {"CPU": 10.0}
    with pytest.raises(ValueError, match="unknown device_name 'xpu'"):
        RayResourcePool([2], device_name="xpu")


def test_worker_group_refuses_unknown_keywords(caplog) -> None:
    with pytest.raises(
        TypeError,
        match=r"RayWorkerGroup\(\) got unexpected keyword argument\(s\) "
        r"\['call_timout_s'\] \(did you mean 'call_timeout_s'\?\)",
    ):
        RayWorkerGroup(None, call_timout_s=5)
    with pytest.raises(TypeError, match=r"WorkerGroup\(\) got unexpected keyword argument\(s\) \['a', 'b'\]"):
        WorkerGroup(None, a=1, b=2)
    # verl's profiler options are accepted (its trainer passes them) and ignored, aloud
    with pytest.raises(ValueError, match="attaching needs worker_names"):
        RayWorkerGroup(None, profile_steps=[1])
    assert "profile_steps / worker_nsight_options are accepted" in caplog.text
    with pytest.raises(ValueError, match="unknown device_name 'gpu0'"):
        RayWorkerGroup(None, device_name="gpu0")


# ---- with Ray ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool2(ray_session):
    # verl's keyword names, all of them
    pool = RayResourcePool(
        process_on_nodes=[2],
        use_gpu=False,
        name_prefix="strict",
        max_colocate_count=2,
        detached=False,
        accelerator_type=None,
    )
    yield pool
    pool.remove()


def test_ray_remote_classes_work(pool2: RayResourcePool) -> None:
    for cls in (Decorated, ray.remote(Plain)):
        spec = RayClassWithInitArgs(cls=cls, x=2)
        wg = RayWorkerGroup(
            resource_pool=pool2,
            ray_cls_with_init=spec,
            name_prefix="remote_",
            ray_wait_register_center_timeout=120,
        )
        try:
            assert wg.worker_names[0].startswith(f"remote_{spec.user_cls.__name__}_0:")
            if cls is Decorated:
                assert wg.plus(3) == [5, 6]
            else:
                assert wg.values() == [(0, 2, 1, None, None), (1, 2, 1, None, None)]
        finally:
            wg.kill()


def test_decorator_options_and_runtime_env_are_kept(pool2: RayResourcePool) -> None:
    spec = RayClassWithInitArgs(DecoratedWithOptions, 4, y=5)
    spec.update_options({"runtime_env": {"env_vars": {"FROM_OPTIONS": "too"}}})
    wg = RayWorkerGroup(pool2, spec, device_name="cpu")
    try:
        assert wg.values() == [(0, 4, 5, "yes", "too"), (1, 4, 5, "yes", "too")]
        assert wg.execute_all_sync("get_env", ("RANK", "FROM_DECORATOR")) == [
            {"RANK": "0", "FROM_DECORATOR": "yes"},
            {"RANK": "1", "FROM_DECORATOR": "yes"},
        ]
    finally:
        wg.kill()
