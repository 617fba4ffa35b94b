"""Read a training job's log lines from CloudWatch Logs, where SageMaker sends them.

One stream per host (``<job>/algo-1-<time>``); every rank's output arrives in
the first host's stream, because mpirun runs there and collects it. A reader
remembers where it stopped in each stream, so ``read_new()`` returns each
line once.
"""

from __future__ import annotations

from typing import Any

LOG_GROUP = "/aws/sagemaker/TrainingJobs"


class TrainingJobLogs:
    def __init__(self, logs_client: Any, job_name: str):
        self._client = logs_client
        self._job_name = job_name
        self._tokens: dict[str, str | None] = {}

    def read_new(self) -> list[str]:
        """Lines written since the last call (all of them on the first), stream by stream."""
        lines: list[str] = []
        for stream in self._streams():
            lines += self._read_stream(stream)
        return lines

    def _read_stream(self, stream: str) -> list[str]:
        lines, token = [], self._tokens.get(stream)
        while True:
            arguments = {"logGroupName": LOG_GROUP, "logStreamName": stream, "startFromHead": True}
            if token:
                arguments["nextToken"] = token
            response = self._client.get_log_events(**arguments)
            events, next_token = response.get("events", []), response.get("nextForwardToken")
            lines += [event["message"].rstrip("\n") for event in events]
            finished = not events or next_token == token
            token = next_token
            if finished:
                break
        self._tokens[stream] = token
        return lines

    def _streams(self) -> list[str]:
        names: list[str] = []
        arguments = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{self._job_name}/"}
        try:
            while True:
                response = self._client.describe_log_streams(**arguments)
                names += [stream["logStreamName"] for stream in response.get("logStreams", [])]
                if not response.get("nextToken"):
                    return sorted(names)
                arguments["nextToken"] = response["nextToken"]
        except self._client.exceptions.ResourceNotFoundException:
            return []  # no log group yet: the job has not started writing
