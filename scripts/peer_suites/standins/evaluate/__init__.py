"""Stand-in for the ``evaluate`` package, put on PYTHONPATH by the peer-suite runner only where ``evaluate`` is
not installed. The peers' training scripts call ``evaluate.load("glue", "mrpc")`` (a metric fetched from the Hub)
and then ``add_batch`` / ``compute``; this computes the same two numbers (accuracy, binary F1) locally."""

__all__ = ["load"]


class _GlueMetric:
    def __init__(self, config_name):
        self.config_name = config_name
        self._predictions = []
        self._references = []

    def add_batch(self, *, predictions, references):
        self._predictions += [int(p) for p in predictions]
        self._references += [int(r) for r in references]

    def compute(self, *, predictions=None, references=None):
        if predictions is not None:
            self.add_batch(predictions=predictions, references=references)
        pairs = list(zip(self._predictions, self._references))
        self._predictions, self._references = [], []
        accuracy = sum(p == r for p, r in pairs) / max(len(pairs), 1)
        if self.config_name not in ("mrpc", "qqp"):
            return {"accuracy": accuracy}
        tp = sum(p == 1 and r == 1 for p, r in pairs)
        fp = sum(p == 1 and r == 0 for p, r in pairs)
        fn = sum(p == 0 and r == 1 for p, r in pairs)
        f1 = 2 * tp / max(2 * tp + fp + fn, 1)
        return {"accuracy": accuracy, "f1": f1}


def load(path, config_name=None, **kwargs):
    if path != "glue":
        raise ValueError(f"the peer-suite evaluate stand-in knows the 'glue' metric only, not {path!r}")
    return _GlueMetric(config_name)
