"""`nfab.attach` refuses what it can check at the call, before the hook is registered (never inside backward).

One real gloo process group of one rank: DDP needs a group, and these checks run before any collective.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.errors import NfabError, ProfileError
from nfab.models import build_model
from nfab.profile.routes import parse_route
from nfab.profile.schema import Profile

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def shipped_resnet(width: int = 16) -> DDP:
    spec = build_model("resnet18", width=width, small_input=True, num_classes=10, in_channels=1, seed=0)
    return DDP(spec.module)


def _probe_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def hooked(ddp: DDP) -> bool:
    """Whether a comm hook was registered (DDP refuses a second registration; a probe registers one)."""
    try:
        ddp.register_comm_hook(None, _probe_hook)
    except RuntimeError:
        return True
    return False


def test_fraction_phases_need_total_steps(group) -> None:
    ddp = shipped_resnet()
    with pytest.raises(NfabError, match="at a fraction of the run: pass total_steps="):
        nfab.attach(ddp, "resnet18", cost_model=None)
    with pytest.raises(NfabError, match="total_steps must be a positive integer"):
        nfab.attach(ddp, "resnet18", cost_model=None, total_steps=0)
    assert not hooked(ddp)


def test_a_profile_for_another_model_is_refused_from_the_ddp_module(group) -> None:
    ddp = shipped_resnet(width=8)
    with pytest.raises(ProfileError, match="another parameter layout"):
        nfab.attach(ddp, REPO / "calibrations/resnet18/profile.json", cost_model=None, total_steps=100)
    assert not hooked(ddp)


def test_the_matching_model_attaches_by_shipped_name(group) -> None:
    ddp = shipped_resnet()
    runtime = nfab.attach(ddp, "resnet18", cost_model=None, total_steps=100)
    assert runtime is not None and hooked(ddp)


@pytest.mark.parametrize(("route", "match"), [
    ("q3", "unknown route 'q3'"),
    ({"conv": "sign", "cnv": "q8"}, "unknown region 'cnv'"),
    ("conv:sign,norm", "must look like region:route"),
    ({"*.bias": "int4"}, "unknown route 'int4'"),
])
def test_bad_routes_are_refused_at_the_call(group, route, match) -> None:
    ddp = shipped_resnet()
    with pytest.raises(NfabError, match=match):
        nfab.attach(ddp, route=route, cost_model=None)
    assert not hooked(ddp)


def test_one_route_grammar_everywhere(tmp_path: Path) -> None:
    text = "conv:sign,norm:fp32,*.bias:fp32"
    assert parse_route(text) == parse_route({"conv": "sign", "norm": "fp32", "*.bias": "fp32"})
    assert parse_route('{conv: sign, norm: fp32, "*.bias": fp32}') == parse_route(text)
    assert parse_route("sign") == "sign"
    static = Profile.static(text)
    assert static.phases[0].routes == {"conv": "sign", "norm": "fp32"} and static.overrides == {"*.bias": "fp32"}
    from nfab.config.files import config_from_dict

    cfg = config_from_dict({"comm": {"route": text}})
    assert cfg.comm.route == parse_route(text)
    assert json.loads(json.dumps(cfg.to_dict()))["comm"]["route"] == parse_route(text)


def test_noise_moment_needs_the_optimizer_it_corrects(group) -> None:
    ddp = shipped_resnet()
    with pytest.raises(NfabError, match="noise_moment=True needs optimizer="):
        nfab.attach(ddp, route="bq2", cost_model=None, noise_moment=True)
    assert not hooked(ddp)
    ddp = shipped_resnet()
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)  # no second moment: a warning, nothing to correct
    assert nfab.attach(ddp, route="bq2", cost_model=None, optimizer=sgd, noise_moment=True).moment is None


def test_noise_moment_auto_follows_the_optimizer_and_the_profile(group) -> None:
    """"auto": on for a static route under Adam, off under SGD or without an optimizer; a profile
    turns it on only when it was calibrated with it (`Profile.noise_moment`)."""
    def moment(route=None, profile=None, opt=torch.optim.AdamW, **kw):
        ddp = shipped_resnet()
        optimizer = None if opt is None else opt(ddp.parameters(), lr=0.1)
        return nfab.attach(ddp, profile=profile, route=route, cost_model=None, optimizer=optimizer, **kw).moment

    assert moment("bq2") is not None
    assert moment("bq2", opt=torch.optim.SGD) is None
    assert moment("bq2", opt=None) is None
    assert moment("bq2", noise_moment=False) is None
    with pytest.raises(NfabError, match="noise_moment must be"):
        moment("bq2", noise_moment="yes")
    static = Profile.static("bq2")
    assert not static.noise_moment and moment(profile=static) is None  # validated without it: runs so
    assert moment(profile=static, noise_moment=True) is not None
    assert moment(profile=static.model_copy(update={"noise_moment": True})) is not None


@pytest.mark.parametrize(("optimizer", "dense"), [(torch.optim.AdamW, True), (torch.optim.SGD, False)])
def test_the_first_steps_probe_densely_only_under_a_second_moment(group, optimizer, dense) -> None:
    """Dense early probes feed the drift monitor, which reads Adam's second moment and acts on nothing
    else. Under SGD they were taken anyway: on resnet18-digits `--route sign` (100 steps, W=2) 1.0 MB of
    probes in steps 0-19, 10% of the run's bytes (28.6x fewer than FP32 where 31.7x without them), and the
    regular probes of steps 20-99 found their budget spent."""
    ddp = shipped_resnet()
    rt = nfab.attach(ddp, route="sign", cost_model=None, optimizer=optimizer(ddp.parameters(), lr=0.1))
    h = rt.profile.health
    probed = []
    for step in range(h.dense_probe_steps):
        rt.step = step
        probed.append(bool(rt.probe_regions(rt.controller.phase(step))))
    assert all(probed) is dense
    if not dense:  # the regular probes: every `probe_every` steps
        assert probed == [step % h.probe_every == 0 for step in range(h.dense_probe_steps)]


def test_a_route_on_probation_is_probed_every_step(group) -> None:
    """After a drift demotion's re-admission (`HealthState.probation_until`) the hook probes every step,
    not every `probe_every`: a route that drifted before is seen drifting again within a few steps."""
    ddp = shipped_resnet()
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rt = nfab.attach(ddp, route="sign", cost_model=None, optimizer=opt)
    h = rt.profile.health
    def probed() -> frozenset[str]:
        return rt.probe_regions(rt.controller.phase(rt.step))

    rt.step = h.dense_probe_steps + 1  # past the early dense probes, between two regular ones
    assert rt.step % h.probe_every != 0 and not probed()
    rt.health.probation_until = rt.step + 3
    rt.step += 1  # the regions are decided once per step
    assert len(probed()) == 1  # one region per probe, in rotation
    rt.step += 2
    assert bool(probed()) is (rt.step % h.probe_every == 0)


def test_a_route_glob_that_matches_no_parameter_is_refused(group) -> None:
    """A typo in a parameter glob (`lyr1.*` for `layer1.*`) would leave every parameter FP32 silently."""
    ddp = shipped_resnet()
    with pytest.raises(NfabError, match=r"route glob 'lyr1\.\*' matches no trainable parameter .*conv1\.weight"):
        nfab.attach(ddp, route={"conv": "sign", "lyr1.*": "bq2"}, cost_model=None)
    assert not hooked(ddp)
    assert nfab.attach(shipped_resnet(), route={"layer1.*": "bq2"}, cost_model=None) is not None


def test_a_second_attach_is_refused_before_it_touches_the_optimizer(group) -> None:
    """DDP takes one comm hook: a second attach, or one after the user's own `register_comm_hook`,
    is one NfabError and leaves no optimizer hook of its own behind (it used to add one, then fail
    with torch's RuntimeError)."""
    ddp = shipped_resnet()
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    nfab.attach(ddp, route="bq2", cost_model=None, optimizer=opt)
    before = len(opt._optimizer_step_pre_hooks)
    with pytest.raises(NfabError, match="already has a communication hook"):
        nfab.attach(ddp, route="bq2", cost_model=None, optimizer=opt)
    assert len(opt._optimizer_step_pre_hooks) == before
    ddp = shipped_resnet()
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ddp.register_comm_hook(None, _probe_hook)
    with pytest.raises(NfabError, match="already has a communication hook"):
        nfab.attach(ddp, route="bq2", cost_model=None, optimizer=opt)
    assert not opt._optimizer_step_pre_hooks


def test_an_optimizer_of_another_model_is_refused(group) -> None:
    ddp = shipped_resnet()
    other = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=1e-3)
    with pytest.raises(NfabError, match="steps none of this model's parameters"):
        nfab.attach(ddp, route="bq2", cost_model=None, optimizer=other)
    assert not hooked(ddp)
    ddp = shipped_resnet()
    first = list(ddp.parameters())[:3]  # a model split between optimizers passes one of them
    assert nfab.attach(ddp, route="bq2", cost_model=None, optimizer=torch.optim.SGD(first, lr=0.1)) is not None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cost_model": 5}, "cost_model must be 'measure', 'link:...', a JSON path, a CostModel or None, got int"),
    ({"seed": "x"}, "seed must be an int"),
    ({"head_modules": "fc"}, "head_modules must be a tuple of module names"),
])
def test_argument_types_are_checked_at_the_call(group, kwargs, match) -> None:
    """`cost_model=5` used to fail inside backward, 11 frames deep; `seed="x"` trained."""
    ddp = shipped_resnet()
    with pytest.raises(NfabError, match=match):
        nfab.attach(ddp, route="bq2", **{"cost_model": None, **kwargs})
    assert not hooked(ddp)


@pytest.mark.parametrize(("build", "match"), [
    (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 2)),
     r"parameter '0.weight' is torch.float64"),
    (lambda: torch.nn.Sequential(torch.nn.Embedding(16, 4, sparse=True), torch.nn.Linear(4, 2)),
     r"Embedding '0' has sparse=True"),
])
def test_a_gradient_the_hook_cannot_reduce_is_refused_at_the_call(group, build, match) -> None:
    """Both pass through plain DDP; under nfab both failed inside the first backward, on every
    route fp32 included (the norm pass: 'dtype Double'; the bucket plan: 'no storage')."""
    ddp = DDP(build())
    with pytest.raises(NfabError, match=match):
        nfab.attach(ddp, route="bq2", cost_model=None)
    assert not hooked(ddp)
    frozen = build()
    for p in frozen[0].parameters():
        p.requires_grad_(False)  # a frozen float64 table or sparse embedding sends no gradient: fine
    assert nfab.attach(DDP(frozen), route="bq2", cost_model=None) is not None  # the fp32 layer after it is


def test_a_compiled_model_takes_the_profile_of_the_model_it_compiles(group) -> None:
    """`DDP(torch.compile(model))` names every parameter `_orig_mod.<name>`: the shipped profile's
    signature, its globs and the regions read the model's own names (it was refused as 'another
    parameter layout')."""
    ddp = DDP(torch.compile(build_model("resnet18", width=16, small_input=True, num_classes=10,
                                        in_channels=1, seed=0).module))
    assert next(iter(dict(ddp.module.named_parameters()))).startswith("_orig_mod.")
    runtime = nfab.attach(ddp, "resnet18", cost_model=None, total_steps=100)
    assert hooked(ddp)
    plain = nfab.attach(shipped_resnet(), "resnet18", cost_model=None, total_steps=100)
    assert runtime.regions == plain.regions and "conv" in runtime.regions.values()
    glob = nfab.attach(DDP(torch.compile(shipped_resnet().module)), route={"layer1.*": "bq2"}, cost_model=None)
    assert glob is not None


def _lm() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))


@pytest.mark.parametrize(("route", "optimizer", "find_unused", "warned"), [
    ("sign", "adamw", False, "embedding rows a batch does not touch"),
    ({"linear": "sign", "embedding": "bq2"}, "adamw", False, None),  # no embedding on sign: nothing to say
    ({"linear": "sign", "embedding": "bq2"}, "adamw", True, "parameters unused on some ranks"),
    ("sign", "sgd", True, None),  # error feedback carries what the vote dropped
    ("bq2", "adamw", True, None),  # a block route keeps a zero exactly zero
])
def test_a_sign_route_that_will_meet_exact_zeros_is_named_at_attach(group, caplog, route, optimizer, find_unused,
                                                                    warned) -> None:
    """One bit cannot abstain: an exact zero votes positive. On a user's untied GPT under AdamW the
    rows of never-seen tokens moved 0.51 in 30 steps under sign, 0 under DDP and bq2."""
    ddp = DDP(_lm(), find_unused_parameters=find_unused)
    opt = (torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD)(ddp.parameters(), lr=1e-3)
    with caplog.at_level("WARNING", logger="nfab"):
        nfab.attach(ddp, route=route, cost_model=None, optimizer=opt)
    lines = [r.getMessage() for r in caplog.records if "cannot abstain" in r.getMessage()]
    if warned is None:
        assert not lines
    else:
        assert len(lines) == 1 and warned in lines[0]


def test_the_error_attach_raises_is_importable_from_nfab() -> None:
    """README and api.md promise 'one NfabError at the call': `except nfab.NfabError` raised AttributeError."""
    assert nfab.NfabError is NfabError and nfab.ProfileError is ProfileError
    assert issubclass(nfab.ProfileError, nfab.NfabError)


def test_a_broken_calibrated_setting_is_refused_by_attach_as_by_the_cli(group, tmp_path: Path) -> None:
    """`nfab train` and `nfab profile check` refused `provenance.calibrated.steps: -5`; attach accepted it."""
    data = json.loads((REPO / "calibrations/resnet18/profile.json").read_text())
    data["provenance"]["calibrated"]["colour"] = "red"
    (path := tmp_path / "p.json").write_text(json.dumps(data))
    ddp = shipped_resnet()
    with pytest.raises(ProfileError, match=r"^profile: unknown key 'provenance\.calibrated\.colour'"):
        nfab.attach(ddp, str(path), cost_model=None, total_steps=100)
    assert not hooked(ddp)


@pytest.mark.parametrize(("route", "warned"), [
    ({"linear": "bq2", "head": "sign"}, "names region(s) head that this model has no parameter of"),
    ("linear:bq2,conv:sign", "names region(s) conv"),
    ("bq2", None),  # one route everywhere names no region
    ({"linear": "bq2", "embedding": "bq2"}, None),
])
def test_a_route_naming_a_region_the_model_lacks_is_named_at_attach(group, caplog, route, warned) -> None:
    """On a GPT whose head is tied to its embedding, `head: sign` matched nothing and that weight went FP32."""
    ddp = DDP(_lm())
    with caplog.at_level("WARNING", logger="nfab"):
        nfab.attach(ddp, route=route, cost_model=None)
    lines = [r.getMessage() for r in caplog.records if "that this model has no parameter of" in r.getMessage()]
    if warned is None:
        assert not lines
    else:
        assert len(lines) == 1 and warned in lines[0]


def test_a_config_attaches_as_the_same_keywords_do(group) -> None:
    """`attach(ddp, config=AttachConfig(...))` is `attach(ddp, **the same options)`; keywords beside it win."""
    route = {"conv": "sign", "*.bias": "fp32"}
    by_config = nfab.attach(shipped_resnet(), config=nfab.AttachConfig(route=route, cost_model=None, seed=7), seed=3)
    by_keywords = nfab.attach(shipped_resnet(), route=route, cost_model=None, seed=3)
    assert by_config.regions == by_keywords.regions and by_config.profile == by_keywords.profile
    assert by_config.seed == by_keywords.seed == 3
