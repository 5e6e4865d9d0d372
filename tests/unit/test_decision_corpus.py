"""The conductor decides exactly as it did before its decision was made sublinear.

tests/unit/data/decisions.jsonl holds the decisions the earlier implementation made on a
seeded corpus of cluster states and requests (tests/unit/decision_corpus.py: five
policies, 1 to 1,024 prefill instances, ties, pulls, rejections, colocated layouts, silent
and draining instances, dispatch accounting between decisions). Every field must be
equal, floats bit for bit, the candidates it reports (the SQL record's) included.
"""

import json

from tests.unit.decision_corpus import GOLDEN, corpus


def test_every_decision_of_the_corpus_is_as_recorded():
    want = GOLDEN.read_text().splitlines()
    got = [json.dumps(r) for r in corpus()]
    assert len(got) == len(want)
    bad = [(w, g) for w, g in zip(want, got) if w != g]
    assert not bad, f"{len(bad)} of {len(want)} differ; first, recorded then now:\n" + "\n".join(
        bad[0]
    )
