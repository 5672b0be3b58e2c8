"""The ``pd-cache`` command: ``cli`` and its subcommands (``run``, ``names``), the Ray
``session`` they start, ``flags`` derived from configs, and the demo ``workload``."""
