"""The batch scheduler as it was before its incremental state (commit 4cd3f74), kept only as a test oracle.

Every module here is that commit's `cacheflow_common/sched/<module>.py`, unchanged but for its imports:
the straightforward passes over the batch (each decision re-sums every request's pending units) that the
product's indexed state must agree with, decision for decision (`tests/common/test_sched_oracle.py`).
Never imported by the product.
"""

from tests.common.sched_oracle.scheduler import BatchScheduler

__all__ = ["BatchScheduler"]
