"""Which sequences make each step's global batch: for every row, a token stream and an offset.

Every way below is a function of (seed, step) alone, never of the layout, so every layout trains
on the same sequences and a resume (on any layout) continues exactly; dp rank r takes its slice
(`batches.sampler_micro_batches`). Global sample g = (step - 1) * global_batch_size + row.

- random (data.sampling=random, the default): `global_batch_rows`, windows of
  seq_len + 1 tokens at offsets drawn anew each step from a generator seeded by (seed, step).
- epochs (data.sampling=epochs), Megatron-LM's: the train split is cut into
  n = (tokens - 1) // seq_len sequences, sequence i = tokens[i*seq_len : (i+1)*seq_len + 1];
  epoch e reads them in a permutation seeded by (seed, source, e); sample g is epoch g // n,
  position g % n of that order. Every sequence once per epoch.
- blend (data.blend), Megatron-LM's blended dataset: with weights w_k normalised to sum 1, sample g
  comes from the source with the largest deficit w_k * (g + 1) - c_k(g), where c_k(g) is how many
  of the samples before g source k gave (ties to the first listed); it is source k's c_k(g)-th
  sample, read in source k's own order (epochs as above, seeded with k; or random: the rows a
  step takes from source k are windows at offsets seeded by (seed, k, step)). With up to three
  sources, c_k(N) stays within one sample of w_k * N over any first N samples (the largest
  deficit is > 0, so a picked one stays above -1; two above +1 would leave the third below -1);
  with more, the greedy may stray a little further (1.12 at most over 200 random blends of 2 to 8
  sources). Validation draws from the sources' val splits with the same rule (random windows,
  fixed per evaluation batch).

The deficits are compared exactly: a weight is the decimal the config wrote (Fraction(repr(w))),
so with integer weights W_k summing to S (after removing their common factor) the comparison is
of integers, and after S samples every source has had exactly W_k: the assignment repeats with
period S. Up to MAX_PERIOD the period is computed once and any step's rows are arithmetic; a
longer one (weights like 0.1234567) walks the samples before the step once per process and then
continues from where it stopped.
"""

import hashlib
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from partrain.config.paths import relative_note, what_is
from partrain.data.tokenizer import TOKENIZER_FILE
from partrain.data.tokens import check_data, fingerprint, load_tokens
from partrain.errors import ConfigError

# A period of up to this many samples is computed once (about a second of Python at most).
MAX_PERIOD = 1 << 20
# Generator keys: (seed, tag, ...), a fixed length per tag (numpy's SeedSequence reads a
# missing trailing word as 0). Tags 0 and 1 are global_batch_rows' (train, val).
_SPLIT_IDS = {"train": 0, "val": 1}
_EPOCH_TAG, _BLEND_TRAIN_TAG, _BLEND_VAL_TAG = 2, 3, 4


def global_batch_rows(n_tokens: int, step: int, global_batch_size: int, seq_len: int, seed: int,
                      split: str = "train") -> np.ndarray:
    """Start offsets of the global batch's sequences for one step (data.sampling=random)."""
    rng = np.random.default_rng([seed, _SPLIT_IDS[split], step])
    return rng.integers(0, n_tokens - seq_len - 1, size=global_batch_size, endpoint=True)


class BlendSchedule:
    """Which source global sample g comes from, and its index among that source's samples."""

    def __init__(self, weights):
        exact = [Fraction(repr(float(w))) for w in weights]
        den = math.lcm(*(f.denominator for f in exact))
        ints = [f.numerator * (den // f.denominator) for f in exact]
        common = math.gcd(*ints)
        self.W = [w // common for w in ints]
        self.S = sum(self.W)
        self.periodic = self.S <= MAX_PERIOD
        self._restart()
        if self.periodic:
            src, idx = self._walk(self.S, record=True)
            self.pattern = np.asarray(src, dtype=np.int64)
            self.rank = np.asarray(idx, dtype=np.int64)
            self._per_period = np.asarray(self.W, dtype=np.int64)

    def _restart(self) -> None:
        # The walk's state before sample `at`: D_k = W_k * at - c_k * S (the deficits times S).
        self.at, self.D, self.counts = 0, [0] * len(self.W), [0] * len(self.W)

    def _walk(self, n: int, record: bool):
        """The greedy over the next n samples, from the state at `self.at`: (source, index in
        source) of each when `record`."""
        return (self._walk3 if len(self.W) <= 3 else self._walk_any)(n, record)

    def _walk_any(self, n: int, record: bool):
        W, S, D, counts = self.W, self.S, self.D, self.counts
        src, idx = ([0] * n, [0] * n) if record else (None, None)
        for i in range(n):
            D = [d + w for d, w in zip(D, W)]
            best = D.index(max(D))  # the first of equal deficits
            D[best] -= S
            if record:
                src[i], idx[i] = best, counts[best]
            counts[best] += 1
        self.D, self.at = D, self.at + n
        return src, idx

    def _walk3(self, n: int, record: bool):
        """_walk_any for up to three sources, in scalars: 4x faster, for a resume's walk. A
        missing source has weight 0 and is never picked (the largest deficit is > 0)."""
        K, S = len(self.W), self.S
        w0, w1, w2 = self.W + [0] * (3 - K)
        d0, d1, d2 = self.D + [0] * (3 - K)
        counts = self.counts + [0] * (3 - K)
        src, idx = ([], []) if record else (None, None)
        for _ in range(n):
            d0 += w0
            d1 += w1
            d2 += w2
            if d0 >= d1 and d0 >= d2:  # the first of equal deficits
                k, d0 = 0, d0 - S
            elif d1 >= d2:
                k, d1 = 1, d1 - S
            else:
                k, d2 = 2, d2 - S
            if record:
                src.append(k)
                idx.append(counts[k])
            counts[k] += 1
        self.D, self.counts, self.at = [d0, d1, d2][:K], counts[:K], self.at + n
        return src, idx

    def lookup(self, g0: int, n: int):
        """(source, index in source) of samples g0 .. g0 + n - 1, and each source's count of
        the samples before g0 + n."""
        if self.periodic:
            q, r = np.divmod(np.arange(g0, g0 + n, dtype=np.int64), self.S)
            src = self.pattern[r]
            end_q, end_r = divmod(g0 + n, self.S)
            counts = end_q * self._per_period + np.bincount(self.pattern[:end_r],
                                                            minlength=len(self.W))
            return src, q * self._per_period[src] + self.rank[r], counts
        if g0 < self.at:
            self._restart()
        self._walk(g0 - self.at, record=False)
        src, idx = self._walk(n, record=True)
        return (np.asarray(src, dtype=np.int64), np.asarray(idx, dtype=np.int64),
                np.asarray(self.counts, dtype=np.int64))


class EpochOrder:
    """One stream's sequences in epochs: index i is epoch i // n, position i % n of a
    permutation seeded by (seed, source, epoch). Keeps the last two epochs' permutations (n
    int64 each): a step may straddle an epoch's end."""

    def __init__(self, n_tokens: int, seq_len: int, seed: int, source: int):
        self.n = (n_tokens - 1) // seq_len
        self.seq_len, self.seed, self.source = seq_len, seed, source
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[next(iter(self._perms))]
            rng = np.random.default_rng([self.seed, _EPOCH_TAG, self.source, epoch])
            self._perms[epoch] = rng.permutation(self.n)
        return self._perms[epoch]

    def starts(self, idx: np.ndarray, step: int) -> np.ndarray:
        epoch, pos = np.divmod(idx, self.n)
        out = np.empty_like(idx)
        for e in np.unique(epoch):
            here = epoch == e
            out[here] = self.permutation(int(e))[pos[here]] * self.seq_len
        return out


class RandomOrder:
    """A blended source's rows of one step as random windows, seeded by (seed, source, step)."""

    def __init__(self, n_tokens: int, seq_len: int, seed: int, source: int, tag: int):
        self.n = (n_tokens - 1) // seq_len  # sequences' worth per epoch, for the epoch metric
        self.high = n_tokens - seq_len - 1
        self.key = (seed, tag, source)

    def starts(self, idx: np.ndarray, step: int) -> np.ndarray:
        rng = np.random.default_rng([*self.key, step])
        return rng.integers(0, self.high, size=len(idx), endpoint=True)


class RandomWindows:
    """One stream, data.sampling=random: the windows of global_batch_rows."""

    def __init__(self, tokens, global_batch_size: int, seq_len: int, seed: int, split: str,
                 docs=None):
        self.streams, self.seq_len = [tokens], seq_len
        self.docs = [docs if docs is not None else np.zeros(1, dtype=np.int64)]
        self.global_batch_size, self.seed, self.split = global_batch_size, seed, split

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream, start offset) of each row of global batch `step`."""
        starts = global_batch_rows(len(self.streams[0]), step, self.global_batch_size,
                                   self.seq_len, self.seed, self.split)
        return np.zeros(len(starts), dtype=np.int64), starts

    def report(self, step: int) -> dict:
        return {}

    def epochs_begun(self, step: int) -> list[str]:
        return []


class Mixture:
    """Epochs over one stream, or a blend of several (each in epochs or random order)."""

    def __init__(self, streams: list, weights: list[float], labels: list[str], *, order: str,
                 global_batch_size: int, seq_len: int, seed: int, split: str = "train",
                 blend: bool, docs: list | None = None):
        self.streams, self.labels, self.blend = streams, labels, blend
        self.docs = docs or [np.zeros(1, dtype=np.int64)] * len(streams)  # document starts
        self.global_batch_size, self.seq_len, self.order = global_batch_size, seq_len, order
        self.first = 1 if split == "train" else 0  # evaluation batches count from 0
        self.schedule = BlendSchedule(weights)
        tag = _BLEND_TRAIN_TAG if split == "train" else _BLEND_VAL_TAG
        self.orders = [EpochOrder(len(s), seq_len, seed, k) if order == "epochs" else
                       RandomOrder(len(s), seq_len, seed, k, tag) for k, s in enumerate(streams)]
        self._last = None  # (step, source, index in source, counts after the step)

    def _lookup(self, step: int):
        if self._last is None or self._last[0] != step:
            g0 = (step - self.first) * self.global_batch_size
            self._last = (step, *self.schedule.lookup(g0, self.global_batch_size))
        return self._last[1:]

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        src, idx, _ = self._lookup(step)
        starts = np.empty(len(src), dtype=np.int64)
        for k, order in enumerate(self.orders):
            mine = np.flatnonzero(src == k)
            if len(mine):
                starts[mine] = order.starts(idx[mine], step)
        return src, starts

    def report(self, step: int) -> dict:
        """The metrics line's `epoch`: the epochs read so far, after this step (1.37: 37% into
        the second); a list in data.blend's order under a blend."""
        _, _, counts = self._lookup(step)
        epochs = [round(int(c) / order.n, 6) for c, order in zip(counts, self.orders)]
        return {"epoch": epochs if self.blend else epochs[0]}

    def epochs_begun(self, step: int) -> list[str]:
        """'<source>: epoch E begins at step S' for each source whose epoch E (from 2) starts
        in this step (epochs order only)."""
        if self.order != "epochs":
            return []
        src, idx, _ = self._lookup(step)
        lines = []
        for k, order in enumerate(self.orders):
            firsts = idx[(src == k) & (idx % order.n == 0) & (idx > 0)]
            lines += [f"{self.labels[k]}: epoch {int(i) // order.n + 1} begins at step {step}"
                      for i in firsts]
        return lines


@dataclass
class Batches:
    """The training and validation samplers, and what the data is, in words."""
    train: object
    val: object
    description: str


def source_config(data_cfg, path: str):
    """The data section of one token dir: how load_tokens and check_data read a blend's source."""
    return OmegaConf.merge(data_cfg, {"source": "tokens", "path": str(path), "blend": None})


def build_batches(data_cfg, train_cfg) -> Batches:
    """The samplers a worker steps with (data.sampling, data.blend; train's batch and seed)."""
    t = train_cfg
    common = dict(global_batch_size=t.global_batch_size, seq_len=t.seq_len, seed=t.seed)
    if data_cfg.blend is None:
        splits = load_tokens(data_cfg)
        val = RandomWindows(splits.val, split="val", docs=splits.val_docs, **common)
        if data_cfg.sampling == "random":
            return Batches(RandomWindows(splits.train, split="train", docs=splits.train_docs,
                                         **common), val, splits.description)
        label = (f"data.path={data_cfg.path}" if data_cfg.source == "tokens"
                 else f"data.source={data_cfg.source}")
        return Batches(Mixture([splits.train], [1.0], [label], order="epochs", blend=False,
                               docs=[splits.train_docs], **common), val,
                       splits.description + ", in epochs")
    entries = list(data_cfg.blend)
    loaded = [load_tokens(source_config(data_cfg, e.path)) for e in entries]
    weights = [e.weight for e in entries]
    labels = [f"data.blend[{k}] ({e.path})" for k, e in enumerate(entries)]
    train = Mixture([s.train for s in loaded], weights, labels, order=data_cfg.sampling,
                    blend=True, docs=[s.train_docs for s in loaded], **common)
    val = Mixture([s.val for s in loaded], weights, labels, order="random", split="val",
                  blend=True, docs=[s.val_docs for s in loaded], **common)
    return Batches(train, val, f"{_describe(entries)}, {data_cfg.sampling}")


def _describe(entries) -> str:
    total = sum(e.weight for e in entries)
    return (f"a blend of {len(entries)} token dirs ("
            + ", ".join(f"{e.path} {e.weight / total:.1%}" for e in entries) + ")")


def _tokenizer(path: Path) -> tuple[str, str | None]:
    """A token dir's tokenizer: meta.json's name, and a digest of its tokenizer.json (two dirs
    may each name "tokenizer.json" and hold different ones)."""
    meta = json.loads((path / "meta.json").read_text(encoding="utf-8-sig"))
    name = meta["tokenizer"]
    digest = None
    if name == TOKENIZER_FILE:
        digest = hashlib.sha256((path / TOKENIZER_FILE).read_bytes()).hexdigest()[:12]
    return name, digest


def _ids(path: Path) -> dict:
    """What a token dir's ids mean beyond its tokenizer.json, as meta.json records it: the
    end-of-text token that `--eot` chose and its id, and the vocab_size (the ids' range)."""
    meta = json.loads((path / "meta.json").read_text(encoding="utf-8-sig"))
    return {"eot": (meta.get("eot_token"), meta.get("eot_id")),
            "vocab_size": meta.get("vocab_size")}


def _same_ids(k: int, path, ids: dict, first: tuple) -> None:
    """Refuse source k whose ids (_ids) differ from the first source's: one tokenizer.json, but
    another --eot ends its documents with another token (the model would learn two separators,
    and sample and export keep only the first source's), or another vocab_size."""
    k0, path0, _, ids0 = first
    eot, eot0 = ids["eot"], ids0["eot"]
    # A dir that records no end-of-text id (an older format's) cannot be compared: let it be.
    if eot[1] is not None and eot0[1] is not None and eot != eot0:
        raise ConfigError(
            f"data.blend[{k0}] ({path0}) ends its documents with {eot0[0]!r} (id {eot0[1]}) but "
            f"data.blend[{k}] ({path}) with {eot[0]!r} (id {eot[1]}), from the same "
            "tokenizer.json: a blend's sources must share one end-of-text token (one document "
            "separator for the model, and the one sample and export use); prepare them with the "
            f"same --eot (e.g. --eot {eot0[0]!r})")
    # The loader widens every source's ids to int64, so dtype alone changes no id; vocab_size
    # does say what the ids range over (an older prepare sized it by the token count).
    if ids["vocab_size"] != ids0["vocab_size"]:
        raise ConfigError(
            f"data.blend[{k0}] ({path0}) has meta.json vocab_size={ids0['vocab_size']} but "
            f"data.blend[{k}] ({path}) vocab_size={ids['vocab_size']}, from the same "
            "tokenizer.json: one of them was prepared otherwise; prepare both again with "
            "`partrain data prepare ... --tokenizer` so that they agree")


def check_sources(cfg) -> str:
    """The data, checked before any process starts: data.path (tokens.check_data), or each dir
    of data.blend as that check would a data.path, and one tokenizer for all of them: the same
    tokenizer.json, end-of-text token and vocab_size."""
    if cfg.data.blend is None:
        return check_data(cfg)
    first = None
    for k, entry in enumerate(cfg.data.blend):
        path = Path(entry.path)
        if what_is(path) == "does not exist":
            raise ConfigError(f"data.blend[{k}].path={entry.path} does not exist"
                              f"{relative_note(entry.path)}; each source "
                              "is a token dir made by `partrain data prepare FILES... --out DIR`")
        one = OmegaConf.merge(cfg, {"data": {"source": "tokens", "path": str(path),
                                             "blend": None}})
        try:
            check_data(one)
            tokenizer, ids = _tokenizer(path), _ids(path)
        except ConfigError as e:
            raise ConfigError(f"data.blend[{k}]: {e}") from None
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"data.blend[{k}].path={path}: meta.json or its tokenizer cannot "
                              f"be read ({e})") from None
        if first is None:
            first = (k, entry.path, tokenizer, ids)
        elif tokenizer == first[2]:
            _same_ids(k, entry.path, ids, first)
        else:
            names = [f"{t[0]}" + (f" (sha256 {t[1]})" if t[1] else "")
                     for t in (first[2], tokenizer)]
            raise ConfigError(
                f"data.blend[{first[0]}] ({first[1]}) was tokenized with {names[0]} but "
                f"data.blend[{k}] ({entry.path}) with {names[1]}: a blend's sources must share "
                "one tokenizer (the same ids must mean the same text); prepare them with the "
                "same --tokenizer")
    return _describe(cfg.data.blend)


def tokenizer_source(data_cfg):
    """The data section whose token dir holds the run's tokenizer: a blend's first source (all
    share one), else data itself."""
    if data_cfg.blend is None:
        return data_cfg
    return source_config(data_cfg, data_cfg.blend[0].path)


def data_fingerprints(data_cfg) -> list[str] | None:
    """The fingerprint (tokens.fingerprint) of each token dir the run reads, in order (one for
    data.path, one per data.blend source); None for the standard library's source. A checkpoint
    records them, so that a resume can tell the same data at another place from other data at
    the same place. OSError where a dir cannot be read."""
    if data_cfg.get("blend") is not None:
        return [fingerprint(Path(entry.path)) for entry in data_cfg.blend]
    if data_cfg.get("source") == "tokens" and data_cfg.get("path"):
        return [fingerprint(Path(data_cfg.path))]
    return None
