"""Moving pages between a worker's host pool and L3: naming runs of a chain (``chain``),
the calls both paths share (``link``), the read path (``prefetch``), the write path
(``backup``), both over one backend (``controller``), and decode's writes (``offload``)."""
