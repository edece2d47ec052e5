"""Engine registry and what every engine shares (request, token choice).

    engine = make_engine("hbsjd", window=16, decoding="greedy", execution="hybrid", gamma=24)
    result = engine.generate(model, labels, prefix, num_new_tokens, cfg_scale=2.0, seed=0)

An engine is a small object holding its options (declared in rollout/options.py); `generate`
validates the call, puts the model in eval mode (no label dropout), sizes the KV cache itself
(R physical rows, 2R with CFG: conditional rows first, then the null-class rows) and returns a
`RolloutResult`.

`slots=S` runs the B images of a call through R = min(S, B) physical rows (continuous
batching): a Jacobi engine prefills the next waiting image into the row of one that finished
and goes on with its round loop; Cached AR, whose images all take N rounds, runs ceil(B / S)
batches.  An image's tokens never depend on its row or on S (keyed random numbers).
"""
from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from rollout.options import (ENGINE_MODULES, ENGINE_OPTIONS, check_engine_name, check_options,
                             engine_options)
from rollout.sampling import (STREAM_TOKEN, check_sampling, image_key, perturb,
                              sample_from, token_logprob, uniform, uses_cfg, warp)
from rollout.spans import Finished, Span, whole_call
from rollout.stats import RolloutResult, normal
from rollout.window import policy_clock

ENGINES: dict[str, type[Engine]] = {}
"""Engine classes by name, each registered under its name in rollout/options.py's
ENGINE_OPTIONS (which also declares the options it takes) when its module (ENGINE_MODULES) is
imported; `engine_class` and `load_engines` import them."""


def register(name: str):
    if name not in ENGINE_OPTIONS:
        raise ValueError(f"engine {name!r} is not declared in rollout/options.py's "
                         f"ENGINE_OPTIONS; add it there with its options")

    def wrap(cls):
        cls.name = name
        ENGINES[name] = cls
        return cls
    return wrap


def engine_class(name: str) -> type[Engine]:
    """The engine class registered under `name`, its module (rollout/options.py
    ENGINE_MODULES) imported first (ValueError naming the known engines)."""
    check_engine_name(name)
    if name not in ENGINES:
        importlib.import_module(ENGINE_MODULES[name])       # registers the module's engines
    if name not in ENGINES:
        raise ValueError(f"engine {name!r}: module {ENGINE_MODULES[name]} registers no engine "
                         f"of that name (rollout/options.py ENGINE_MODULES)")
    return ENGINES[name]


def load_engines() -> dict[str, type[Engine]]:
    """ENGINES with every declared engine registered."""
    for name in ENGINE_OPTIONS:
        engine_class(name)
    return ENGINES


def make_engine(name: str, **options) -> Engine:
    """The engine registered under `name`, with its options checked (ValueError naming the
    option on a bad one)."""
    return engine_class(name)(**options)


@dataclass
class Request:
    """A validated generate call.  B images, P prefix tokens, N new tokens, T = P + N."""
    labels: Tensor        # (B,) int64
    prefix: Tensor        # (B, P) int64
    num_new: int          # N
    cfg_scale: float | None
    temperature: float
    top_k: int | None
    top_p: float | None
    decoding: str         # rollout/options.py DECODINGS
    seeds: Tensor         # (B,) int64 RNG seed of each image
    ids: Tensor           # (B,) int64 RNG image id of each image
    keys: Tensor          # (B,) int64 image_key(seed, id): every uniform hashes it
    slots: int | None = None  # physical rows (continuous batching); None = B
    span: int = 0         # stream spans of this many tokens too (rollout/spans.py); 0 = off

    @property
    def batch(self) -> int:
        return self.labels.shape[0]

    @property
    def rows(self) -> int:
        """Physical rows R = min(slots, B) (without the CFG copies)."""
        return self.batch if self.slots is None else min(self.slots, self.batch)

    def row_batches(self) -> list[Tensor]:
        """The images in consecutive batches of R (what fits the physical rows at once)."""
        dev = self.labels.device
        return [torch.arange(i, min(i + self.rows, self.batch), device=dev)
                for i in range(0, self.batch, self.rows)]

    def take(self, images: Tensor) -> Request:
        """The request for the images `images` (in that order), every image keeping its key."""
        return Request(self.labels[images], self.prefix[images], self.num_new, self.cfg_scale,
                       self.temperature, self.top_k, self.top_p, self.decoding,
                       self.seeds[images], self.ids[images], self.keys[images], self.slots,
                       self.span)

    @property
    def prefix_len(self) -> int:
        return self.prefix.shape[1]

    @property
    def total(self) -> int:
        return self.prefix.shape[1] + self.num_new

    @property
    def cfg(self) -> bool:
        return uses_cfg(self.cfg_scale)

    @property
    def sampled(self) -> bool:
        """Tokens are drawn (decoding "sample" or "speculative"), not the argmax."""
        return self.decoding != "greedy"

    @property
    def speculative(self) -> bool:
        """Decoding "speculative": speculative sampling, drafts with proposals q."""
        return self.decoding == "speculative"

    @property
    def perturbed(self) -> bool:
        """Decoding "sample": the argmax of keyed perturbed scores (`sampling.perturb`)."""
        return self.decoding == "sample"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def make_request(model, labels: Tensor, prefix: Tensor | None, num_new_tokens: int, *,
                 cfg_scale, temperature, top_k, top_p, seed, image_ids, decoding: str,
                 slots: int | None = None, span: int = 0) -> Request:
    """Check a generate call against the model; ValueError naming the bad argument."""
    if not (torch.is_tensor(labels) and labels.dim() == 1 and labels.numel() >= 1):
        raise ValueError(f"labels must be a non-empty (B,) tensor, got "
                         f"{tuple(labels.shape) if torch.is_tensor(labels) else type(labels)}")
    B, device = labels.shape[0], model_device(model, labels.device)
    labels = labels.long().to(device)
    if bool(((labels < 0) | (labels >= model.num_classes)).any()):
        raise ValueError(f"labels must be in [0, num_classes={model.num_classes}); "
                         f"got {labels.tolist()}")
    if prefix is None:
        prefix = torch.zeros(B, 0, dtype=torch.long, device=device)
    if not (torch.is_tensor(prefix) and prefix.dim() == 2 and prefix.shape[0] == B):
        raise ValueError(f"prefix must be a (B={B}, P) tensor, got "
                         f"{tuple(prefix.shape) if torch.is_tensor(prefix) else type(prefix)}")
    prefix = prefix.long().to(device)
    if prefix.numel() and bool(((prefix < 0) | (prefix >= model.vocab_size)).any()):
        raise ValueError(f"prefix tokens must be in [0, vocab_size={model.vocab_size})")
    P = prefix.shape[1]
    if P >= model.block_size:
        raise ValueError(f"prefix of {P} tokens is longer than the sequence allows: a model "
                         f"with block_size {model.block_size} needs P <= {model.block_size - 1}")
    if not _is_int(num_new_tokens) or num_new_tokens < 1:
        raise ValueError(f"num_new_tokens must be an int >= 1, got {num_new_tokens!r}")
    if P + num_new_tokens > model.block_size:
        raise ValueError(f"num_new_tokens={num_new_tokens} overflows the sequence: prefix {P} + "
                         f"{num_new_tokens} > block_size {model.block_size}")
    check_sampling(model.vocab_size, cfg_scale, temperature, top_k, top_p,
                   decoding != "greedy")
    if slots is not None and not (_is_int(slots) and slots >= 1):
        raise ValueError(f"slots must be None or an int >= 1 (physical rows), got {slots!r}")
    if not (_is_int(span) and span >= 0):
        raise ValueError(f"span must be an int >= 0 (tokens per span; 0 = off), got {span!r}")
    seeds = _per_image("seed", seed, B, device)
    ids = (torch.arange(B, device=device) if image_ids is None
           else _per_image("image_ids", image_ids, B, device))
    return Request(labels, prefix, num_new_tokens, cfg_scale, temperature, top_k, top_p,
                   decoding, seeds, ids, image_key(seeds, ids), slots, span)


def model_device(model, default: torch.device) -> torch.device:
    """The device of the model's parameters (inputs are moved there), else `default`."""
    params = getattr(model, "parameters", None)
    p = next(params(), None) if callable(params) else None
    return p.device if p is not None else default


def _per_image(name: str, value, B: int, device) -> Tensor:
    if _is_int(value):
        return torch.full((B,), value, dtype=torch.long, device=device)
    if torch.is_tensor(value) and value.shape == (B,) and not value.is_floating_point():
        return value.long().to(device)
    raise ValueError(f"{name} must be an int or a (B={B},) integer tensor, got {value!r}")


# ---- shared steps ----------------------------------------------------------------------------

def cfg_rows(x: Tensor, req: Request) -> Tensor:
    """(B, ...) -> (2B, ...) the same inputs for the unconditional rows when CFG is on."""
    return torch.cat([x, x]) if req.cfg else x


def choose_token(guided: Tensor, req: Request, position: Tensor, attempt: Tensor,
                 keys: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """guided: (B, V) logits; position, attempt: (B,) -> token (B,) int64 -- the argmax
    (greedy), the keyed Gumbel-max token of (seed, image, position) (decoding "sample",
    `sampling.perturb`), or an inverse-CDF sample keyed by (seed, image, position, attempt)
    (decoding "speculative") -- and its behaviour log-prob (B,) float32
    (`sampling.token_logprob`); keys: the images' keys (default all)."""
    keys = req.keys if keys is None else keys
    if req.perturbed:
        scores, p = perturb(guided, keys[:, None], position[:, None], req.temperature,
                            req.top_k, req.top_p)
        token = scores.argmax(-1)
    else:
        p = warp(guided, req.temperature, req.top_k, req.top_p)
        token = (sample_from(p, uniform(keys, position, attempt, STREAM_TOKEN))
                 if req.speculative else guided.argmax(-1))
    return token, token_logprob(p, token)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Base class: option handling and the timed, validated `generate` wrapper.

    Option compile (every engine): False, or a torch.compile backend (True = "inductor";
    "eager" traces without code generation, for tests): each round -- its verifier forward
    and the choice or verification of its tokens -- is one compiled function with static
    shapes (`Engine.compiled_round`; mode "reduce-overhead" on CUDA, so a round replays as one CUDA
    graph), run on the model's static cache (`static_cache`); prefills stay eager."""
    name = "engine"

    def __init__(self, **options):
        self.options = check_options(self.name, options, engine_options(self.name))
        self._compiled: dict[tuple, object] = {}

    @property
    def compiles(self) -> bool:
        return bool(self.options["compile"])

    def compiled_round(self, fn, device: torch.device):
        """`fn` (a round function of the engine's module), or with option compile its
        torch.compile'd version (compiled per function and device type; dynamic=False: one
        graph per input shape, which callers keep few)."""
        if not self.compiles:
            return fn
        key = (fn, device.type)
        if key not in self._compiled:
            backend = self.options["compile"]
            backend = "inductor" if backend is True else backend
            mode = "reduce-overhead" if backend == "inductor" and device.type == "cuda" else None
            self._compiled[key] = torch.compile(fn, backend=backend, mode=mode, dynamic=False)
        return self._compiled[key]

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"

    @property
    def decoding(self) -> str:
        return self.options["decoding"]

    def generate(self, model, labels: Tensor, prefix: Tensor | None, num_new_tokens: int, *,
                 cfg_scale: float | None = None, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 seed: int | Tensor = 0, image_ids: Tensor | None = None,
                 slots: int | None = None) -> RolloutResult:
        """labels: (B,) class ids, prefix: (B, P) image tokens (or None), N = num_new_tokens.
        Returns a RolloutResult whose `tokens` are (B, P + N) int64.  `seed` and `image_ids`
        (default 0..B-1) key the random numbers of each image; `slots` caps the physical rows
        (continuous batching; None = B).  The whole of `stream`'s call."""
        stream = self.stream(model, labels, prefix, num_new_tokens, cfg_scale=cfg_scale,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                             image_ids=image_ids, slots=slots)
        for _ in stream:
            pass
        return stream.result

    def stream(self, model, labels: Tensor, prefix: Tensor | None, num_new_tokens: int, *,
               cfg_scale: float | None = None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None,
               seed: int | Tensor = 0, image_ids: Tensor | None = None,
               slots: int | None = None, span: int = 0) -> RolloutStream:
        """`generate`'s call as a `RolloutStream`: iterating it runs the rollout and yields each
        group of images as soon as they are complete (`Finished`; with `span` S > 0 also each
        `Span` of S positions once every image has committed it), while the others go on
        decoding; its `result` is then generate's.  Arguments are checked here (ValueError)."""
        req = make_request(model, labels, prefix, num_new_tokens, cfg_scale=cfg_scale,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                           image_ids=image_ids, decoding=self.decoding, slots=slots, span=span)
        self.check_model(model, req)
        if self.compiles and not hasattr(model, "static_cache"):
            raise ValueError("option compile needs a model with static_cache(on) (a fixed-"
                             "length cached attention); opd.models.GPT has one")
        return RolloutStream(self, model, req)

    def check_model(self, model, req: Request) -> None:
        """Engine-specific checks of a call (ValueError)."""

    def cache_len(self, req: Request) -> int:
        """KV cache slots per row the call needs (`setup_cache`'s max_len)."""
        return req.total

    def run(self, model, req: Request) -> RolloutResult:
        raise NotImplementedError

    def run_stream(self, model, req: Request) -> Iterator[Finished | Span]:
        """The rollout as a generator of `Finished` groups (and `Span`s) that returns its
        `RolloutResult`.  Here: `run` whole, then every span and image at once (Cached AR's images
        complete together); Jacobi engines hand them out as they commit (hbsjd.py `run_jacobi`)."""
        result = self.run(model, req)
        yield from whole_call(req.prefix_len, req.span, result)
        return result


class RolloutStream:
    """One rollout call, iterated: `Finished` groups in the order their images complete
    (images completing in the same round form one group, in batch order), and with a span the
    `Span`s in position order, each before the round's group; once exhausted, `result` is the
    call's `RolloutResult` (its wall_time: the seconds spent in the engine, not in the
    consumer between groups; its cpu_time: the same stretches on the window policy's clock
    where that is this thread's CPU seconds, rollout/window.py `policy_clock`).  The model is
    in eval mode, in inference mode, while the engine runs (docs/ROLLOUTS.md, "Inference
    mode"), and what it hands out is made of normal tensors (`stats.normal`)."""

    def __init__(self, engine: Engine, model, req: Request):
        self.engine, self.model, self.req = engine, model, req
        self.result: RolloutResult | None = None

    def __iter__(self) -> Iterator[Finished | Span]:
        engine, model, req = self.engine, self.model, self.req
        was_training = bool(getattr(model, "training", False))
        if was_training:
            model.eval()
        # cpu_time where the window policy prices by this thread's CPU seconds (one CPU thread)
        one_thread = policy_clock(req.labels.device.type,
                                  torch.get_num_threads()) is time.thread_time
        busy = busy_cpu = 0.0
        try:
            start, start_cpu = time.perf_counter(), time.thread_time()
            with torch.inference_mode():     # results leave as normal tensors (`normal`)
                model.setup_cache(req.rows * (2 if req.cfg else 1), engine.cache_len(req))
                if engine.compiles:
                    model.static_cache(True)
                rounds = engine.run_stream(model, req)
            while True:
                with torch.inference_mode():     # per resumption: the consumer's own
                    try:                         # mode holds between groups
                        done = next(rounds)
                    except StopIteration as stop:
                        result = stop.value
                        break
                done = normal(done)
                busy += time.perf_counter() - start
                busy_cpu += time.thread_time() - start_cpu
                yield done
                start, start_cpu = time.perf_counter(), time.thread_time()
            synchronize(req.labels.device)
            result = normal(result)
            result.wall_time = busy + time.perf_counter() - start
            if one_thread:
                result.cpu_time = busy_cpu + time.thread_time() - start_cpu
        finally:
            if engine.compiles:
                model.static_cache(False)
            if was_training:
                model.train()
        result.engine, result.options = engine.name, dict(engine.options)
        self.result = result

