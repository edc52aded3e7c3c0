"""`trainflow audit SOURCE`: the data audit of a dataset on its own, before any training.

    trainflow audit ../photos                       # a folder, any layout train-flow reads
    trainflow audit kaggle:dogs-vs-cats --output audit.json
    trainflow audit ../photos --split.seed 7 --audit.leakage quarantine
    trainflow audit ../photos --training.model mynets:pretrained_lite0   # labels on its backbone

It prepares and splits the dataset exactly as train-flow would (the same home, ledger and
split), so the sides it shows are the sides a run will use, and prints what the audit found:
duplicate groups (and those across splits), likely wrong labels and outliers
(training/data/audit.py). Nothing is trained, nothing is dropped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from training.config import AuditSpec, DatasetSpec, SplitSpec, TrainingSpec
from training.data.labels import DatasetError


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="trainflow audit", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="dataset.source, as train-flow takes it")
    parser.add_argument("--labels", default=None, help="dataset.labels (default: its default)")
    parser.add_argument("--split.seed", dest="seed", type=int, default=SplitSpec().seed)
    parser.add_argument("--audit.leakage", dest="leakage", choices=["report", "quarantine"],
                        default="report")
    parser.add_argument("--training.model", dest="model", default=None,
                        help="check labels on this network's starting backbone when it is "
                        "pretrained (as train-flow's preflight finds it), not on thumbnails")
    parser.add_argument("--output", type=Path, help="also write audit.json here")
    parser.add_argument("--limit", type=int, default=40, help="findings printed (all: 0)")
    args = parser.parse_args(argv)

    from tasks.data import starting_features
    from training.data.sources import prepare
    from training.data.split import split_dataset
    from training.models.arrival import as_it_arrives
    from training.storage import home

    dataset = DatasetSpec(source=args.source, **({"labels": args.labels} if args.labels else {}))
    audit = AuditSpec(leakage=args.leakage,
                      labels_from="backbone" if args.model else "thumbnails")
    features = None
    if args.model:
        resolved = as_it_arrives(TrainingSpec(model=args.model))
        print("\n".join(resolved.notes))
        features = starting_features(resolved.training, audit)
    try:
        ref = prepare(dataset, home())
        result = split_dataset(ref, SplitSpec(seed=args.seed), home(), audit=audit,
                               features=features)
    except DatasetError as e:
        sys.exit(f"trainflow audit: {e}")
    assert result.audit is not None
    print(result.audit.summary)
    print(f"every finding: {result.audit.file}")
    if args.output:
        shutil.copyfile(result.audit.file, args.output)
    findings = json.loads(result.audit.file.read_text())["findings"]
    shown = findings if args.limit == 0 else findings[:args.limit]
    if shown:
        print(f"\n{'kind':<12}{'group':>6}  {'side':<6}{'label':<14}{'suggested':<14}"
              f"{'score':>8}  path")
        for f in shown:
            group = "" if f["group"] is None else f["group"]
            print(f"{f['kind']:<12}{group!s:>6}  {f['side']:<6}{f['label']:<14}"
                  f"{f['suggested'] or '':<14}{f['score']:>8.3g}  {f['path']}")
    if len(shown) < len(findings):
        print(f"... and {len(findings) - len(shown)} more (--limit 0 prints all)")
