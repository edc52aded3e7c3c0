"""The flows. Importing any of them makes a temporary Prefect server (a flow run by hand with
no PREFECT_API_URL) start quietly: its analytics service phones home, which on an offline
machine logs an error at every start and holds SQLite locks while the engine starts. An
explicit PREFECT_SERVER_ANALYTICS_ENABLED still wins.
"""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
