"""The `retrain` command line."""

import os

# Prefect's own usage data, off for what this command starts unless the user says otherwise:
# its machines are often offline spot nodes and CI runners, where the client's telemetry queue
# and the temporary server's analytics only fail, and a first-run notice about a server the
# user never started confuses. DO_NOT_TRACK=0 or PREFECT_SERVER_ANALYTICS_ENABLED=true opt in.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
