"""Robustness fuzzing of the objective language and the lowering (issue 7).

* :mod:`fuzz.strategies` — hypothesis strategies for random well-formed objective trees
  (:func:`well_formed`) and for malformed ones (:func:`malformed`);
* :mod:`fuzz.properties` — the checks applied to each drawn case;
* :mod:`fuzz.stats` — outcome counting (``hypothesis.event`` + a JSON file under ``/tmp``).
"""
