"""Data sets that ship with packages or are generated locally (never downloaded at run time).

* ``digits``: scikit-learn's bundled ``load_digits`` (1797 8×8 images, 10 classes), a stratified
  80/20 split;
* ``mnist1d``: MNIST-1D generated procedurally by the ``mnist1d`` package
  (``make_dataset(get_dataset_args())``: 4000 train / 1000 test signals of length 40, 10 classes);
  its download path is never used;
* ``mnist1d-large-test``: the same 4000 training signals with a held-out test set of 12 000
  signals drawn apart by the same generator (another seed);
* ``mnist1d-shuffled``: the same with the spatial dimension permuted by one fixed permutation
  (a model that relies on locality loses it).

Every set is standardised with the scalar mean and standard deviation of its training part:
``x ← (x - μ_train) / σ_train``.  Corruptions for robustness checks (Gaussian noise, Gaussian blur)
and shift augmentation are generated in code, seeded.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import torch

from convex_eq.errors import OptionError


@dataclass(frozen=True)
class Dataset:
    """A classification set: ``x_*`` of shape ``(N, *shape)`` (float32), ``y_*`` class labels."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int = 10

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of one sample: ``(C, L)`` (signals) or ``(C, H, W)`` (images)."""
        return tuple(self.x_train.shape[1:])

    def to(self, device: str | torch.device) -> Dataset:
        """The same set on ``device``."""
        return replace(self, **{k: getattr(self, k).to(device)
                                for k in ("x_train", "y_train", "x_test", "y_test")})

    def validation_split(self, fraction: float = 0.1, seed: int = 0) -> Dataset:
        """Hold out ``fraction`` of the *training* part as the test part of the returned set (for
        choices made without looking at the test set); the returned set's name ends in
        ``/val``."""
        if not 0 < fraction < 1:
            raise OptionError(f"validation fraction {fraction} must lie in (0, 1)",
                              term="validation_split")
        n = len(self.y_train)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        k = round(fraction * n)
        val, tr = perm[:k].to(self.x_train.device), perm[k:].to(self.x_train.device)
        return replace(self, name=f"{self.name}/val", x_train=self.x_train[tr],
                       y_train=self.y_train[tr], x_test=self.x_train[val],
                       y_test=self.y_train[val])

    def with_test(self, x_test: torch.Tensor, suffix: str) -> Dataset:
        """The same set with another test input (e.g. a corrupted copy); name ``name+suffix``."""
        if x_test.shape != self.x_test.shape:
            raise OptionError(f"test input of shape {tuple(x_test.shape)} replaces one of shape "
                              f"{tuple(self.x_test.shape)}", term="with_test")
        return replace(self, name=self.name + suffix, x_test=x_test)


# ----------------------------------------------------------------------------- standardisation
def standardize(train: np.ndarray, *others: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(x - μ) / σ`` with the scalar mean and standard deviation of ``train`` applied to every
    array (no statistic of a test set leaks into the transform)."""
    mu, sd = float(train.mean()), float(train.std())
    if not sd > 0:
        raise OptionError("the training inputs are constant (standard deviation 0)",
                          term="standardize", hint="check the data set")
    return tuple(((a - mu) / sd).astype(np.float32) for a in (train, *others))


def _dataset(name: str, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray
             ) -> Dataset:
    xtr, xte = standardize(xtr, xte)
    return Dataset(name, torch.as_tensor(xtr), torch.as_tensor(ytr, dtype=torch.long),
                   torch.as_tensor(xte), torch.as_tensor(yte, dtype=torch.long))


# ----------------------------------------------------------------------------- the sets
def digits(seed: int = 0, test_size: float = 0.2) -> Dataset:
    """``load_digits`` (bundled with scikit-learn) as ``(1, 8, 8)`` images, stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32).reshape(-1, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_size, random_state=seed,
                                          stratify=y)
    return _dataset("digits", xtr, ytr, xte, yte)


@lru_cache(maxsize=4)
def _mnist1d_arrays(data_seed: int, num_samples: int = 5000) -> tuple[np.ndarray, ...]:
    """MNIST-1D generated by ``mnist1d.data.make_dataset`` (procedural; about a second per 5000
    signals), ``num_samples`` split 80/20.  The package seeds Python's and NumPy's global
    generators: their states are restored after."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as err:  # pragma: no cover - the demo/test extras install it
        raise OptionError("MNIST-1D needs the mnist1d package", term="mnist1d",
                          hint="pip install 'convex-eq[demo]' (or pip install mnist1d)") from err
    args = get_dataset_args()
    args.seed = data_seed
    args.num_samples = num_samples
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        d = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return (d["x"][:, None, :].astype(np.float32), d["y"].astype(np.int64),
            d["x_test"][:, None, :].astype(np.float32), d["y_test"].astype(np.int64))


def mnist1d(data_seed: int = 42) -> Dataset:
    """MNIST-1D (``(1, 40)`` signals; 4000 train / 1000 test) with the package's default
    arguments (``data_seed`` 42 is its default: the set its authors report on)."""
    return _dataset("mnist1d", *_mnist1d_arrays(int(data_seed)))


def mnist1d_large_test(data_seed: int = 42, test_seed: int = 4242, test_size: int = 12000
                       ) -> Dataset:
    """MNIST-1D's 4000 training signals (``data_seed``) with a held-out test set of
    ``test_size`` signals drawn apart by the same generator (``test_seed``: its own
    translations, scalings, shears and noise), standardised with the training statistics: a
    test set large enough that its sampling error (binomial, ``√(p(1−p)/N)``: 0.2 points at
    N = 12 000 and p = 0.95) does not hide differences of a point (docs/reproduce.md)."""
    if test_seed == data_seed:
        raise OptionError("the test draw must use another seed than the training draw",
                          term="mnist1d_large_test", hint=f"pick test_seed ≠ {data_seed}")
    xtr, ytr, _, _ = _mnist1d_arrays(int(data_seed))
    xa, ya, xb, yb = _mnist1d_arrays(int(test_seed), int(test_size))
    xte, yte = np.concatenate([xa, xb]), np.concatenate([ya, yb])
    return _dataset("mnist1d-large-test", xtr, ytr, xte, yte)


def shuffle_spatial(data: Dataset, seed: int = 0) -> Dataset:
    """The spatial positions permuted by one fixed permutation (the same for every sample, train
    and test): the information is kept, its locality is destroyed."""
    sp = data.shape[1:]
    n = int(np.prod(sp))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))

    def shuf(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], x.shape[1], n)
        return flat[..., perm.to(x.device)].reshape(x.shape)

    return replace(data, name=f"{data.name}-shuffled", x_train=shuf(data.x_train),
                   x_test=shuf(data.x_test))


def mnist1d_shuffled(data_seed: int = 42, seed: int = 0) -> Dataset:
    """MNIST-1D with its spatial dimension shuffled (see :func:`shuffle_spatial`)."""
    return shuffle_spatial(mnist1d(data_seed), seed)


#: registry of the data sets by name (``load(name)``)
DATASETS: dict[str, Callable[..., Dataset]] = {
    "digits": digits,
    "mnist1d": mnist1d,
    "mnist1d-large-test": mnist1d_large_test,
    "mnist1d-shuffled": mnist1d_shuffled,
}


def load(name: str, **kwargs: object) -> Dataset:
    """The data set ``name`` (one of :data:`DATASETS`)."""
    if name not in DATASETS:
        raise OptionError(f"unknown data set {name!r}", term="data",
                          hint=f"use one of {sorted(DATASETS)}")
    return DATASETS[name](**kwargs)


# ----------------------------------------------------------------------------- corruptions
def gaussian_noise(x: torch.Tensor, sigma: float, seed: int = 0) -> torch.Tensor:
    """``x + σ·ε``, ``ε ~ N(0, I)`` drawn from a generator seeded with ``seed``."""
    if sigma < 0:
        raise OptionError(f"noise level σ = {sigma} must be ≥ 0", term="gaussian_noise")
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(x.shape, generator=g, dtype=x.dtype)
    return x + sigma * eps.to(x.device)


def blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Gaussian blur of width ``σ`` (pixels) over the spatial dimensions of ``(N, C, *spatial)``
    (``scipy.ndimage.gaussian_filter``, edges extended by the nearest value); σ = 0 is x."""
    if sigma < 0:
        raise OptionError(f"blur width σ = {sigma} must be ≥ 0", term="blur")
    if sigma == 0:
        return x.clone()
    from scipy.ndimage import gaussian_filter

    widths = (0.0, 0.0) + (float(sigma),) * (x.ndim - 2)
    out = gaussian_filter(x.detach().cpu().double().numpy(), sigma=widths, mode="nearest")
    return torch.as_tensor(out, dtype=x.dtype, device=x.device)


#: corruptions of a test input by name: ``(x, level, seed) -> x'``
CORRUPTIONS: dict[str, Callable[[torch.Tensor, float, int], torch.Tensor]] = {
    "noise": lambda x, level, seed: gaussian_noise(x, level, seed),
    "blur": lambda x, level, seed: blur(x, level),
}


def corrupted(data: Dataset, kind: str, level: float, seed: int = 0) -> Dataset:
    """``data`` with its test inputs corrupted by ``kind`` (``noise``: σ of the added Gaussian
    noise; ``blur``: σ of the Gaussian blur) at ``level``; the training part is unchanged."""
    if kind not in CORRUPTIONS:
        raise OptionError(f"unknown corruption {kind!r}", term="corrupted",
                          hint=f"use one of {sorted(CORRUPTIONS)}")
    return data.with_test(CORRUPTIONS[kind](data.x_test, level, seed), f"+{kind}({level:g})")


# ----------------------------------------------------------------------------- augmentation
def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
    """Each sample of ``(N, C, L)`` shifted along its last axis by an integer drawn uniformly in
    ``[-max_shift, max_shift]``, zeros shifted in (augmentation; the same for every model)."""
    if max_shift < 0:
        raise OptionError(f"max_shift = {max_shift} must be ≥ 0", term="random_shift")
    if max_shift == 0:
        return x
    n, length = x.shape[0], x.shape[-1]
    s = torch.randint(-max_shift, max_shift + 1, (n,), generator=generator).to(x.device)
    src = torch.arange(length, device=x.device)[None, :] - s[:, None]  # out[j] = x[j - s]
    valid = (src >= 0) & (src < length)
    view = (n, *([1] * (x.ndim - 2)), length)
    idx = src.clamp(0, length - 1).view(view).expand_as(x)
    return torch.gather(x, -1, idx) * valid.view(view).to(x.dtype)
