"""The benches' one bootstrap: a statistic of some samples with a 90% interval.
Standard library only, so a bench's parent process need not import torch for it."""

from __future__ import annotations

import random
import statistics
from typing import Callable


def bootstrap(stat: Callable[..., float], *samples: list, paired: bool = False,
              rounds: int = 2000, groups: list | None = None) -> tuple[float, float, float]:
    """(stat(*samples), the 5th and the 95th percentile of stat over ``rounds``
    resamples).  Each sample is resampled on its own, or with ``paired`` (samples of
    one length, element i of each a pair) the pairs are, kept together.  ``groups``
    (paired: a label per pair, e.g. the set of processes it came from): the groups
    are resampled, then the pairs within each group drawn (a two-stage bootstrap), so
    that what the pairs of a group share widens the interval as it should."""
    rng = random.Random(0)
    members: dict = {}
    for i, label in enumerate(groups if groups is not None and len(set(groups)) > 1 else ()):
        members.setdefault(label, []).append(i)
    labels = list(members)
    boot = []
    for _ in range(rounds):
        if not (paired or members):
            boot.append(stat(*(rng.choices(sample, k=len(sample)) for sample in samples)))
            continue
        if members:
            picks = [i for label in rng.choices(labels, k=len(labels))
                     for i in rng.choices(members[label], k=len(members[label]))]
        else:
            picks = rng.choices(range(len(samples[0])), k=len(samples[0]))
        boot.append(stat(*([sample[i] for i in picks] for sample in samples)))
    boot.sort()
    return stat(*samples), boot[rounds // 20], boot[rounds - rounds // 20 - 1]


def ratio_of_medians(b: list, a: list) -> float:
    return statistics.median(b) / statistics.median(a)


def summary(values: list, scale: float = 1.0) -> tuple[float, float, float, float]:
    """(min, median, low, high) of ``values`` times ``scale``: the median's 90% interval
    is [low, high].  Every bench reports a timing this way."""
    med, low, high = bootstrap(statistics.median, values)
    return min(values) * scale, med * scale, low * scale, high * scale


HEADER = "min / median [90% interval]"


def cells(values: list, scale: float = 1.0, digits: int = 2) -> str:
    """``summary`` as one table cell: ``min / median [low..high]``."""
    best, med, low, high = summary(values, scale)
    return f"{best:.{digits}f} / {med:.{digits}f} [{low:.{digits}f}..{high:.{digits}f}]"
