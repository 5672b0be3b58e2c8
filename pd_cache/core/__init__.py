"""The bottom floor: everything that crosses a process.

``hashing`` (the page-name spec), ``request`` (``Req``, and naming its pages), ``config``
and ``cluster_config`` (every config), ``fields`` (their checks), ``vocab`` (the shared
words), ``stats`` (counts by those words), ``wire`` (what actors send each other).
Nothing here imports torch or Ray, or any higher floor.
"""
