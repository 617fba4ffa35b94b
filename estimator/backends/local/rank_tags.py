"""Turn mpirun's ``--output tag`` prefixes into rank-and-host prefixes.

Open MPI 5 tags every line a rank writes as ``[<jobid>,<rank>]<stdout>: text``
(or ``<stderr>``). The job log shows ``[algo-2 rank3] text`` instead, so a
reader sees which (possibly simulated) host a line came from. Lines mpirun
writes itself carry no tag and become ``[mpirun] text``. A rank's last output
without a newline can run into the next tag on the same line; it is split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from estimator.backends.supervised.rank_tags import LineTagger

TAG_RE = re.compile(r"\[\d+,(?P<rank>\d+)\]<(?:stdout|stderr)>: ?")
MPIRUN_PREFIX = "[mpirun] "


@dataclass(frozen=True)
class RankTagger(LineTagger):
    def retag(self, raw_line: str) -> list[str]:
        return self.split_tagged(raw_line, TAG_RE, MPIRUN_PREFIX, lambda match: int(match["rank"]))
