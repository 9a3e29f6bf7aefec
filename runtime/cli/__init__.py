"""`edgeprefill`: the command line (`main.py`) and its console output (`console.py`)."""
