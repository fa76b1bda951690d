"""Robustness fuzzing of the objective language and the lowering: the helper package of the fuzz
tests in this folder (``test_wellformed.py``, ``test_malformed.py``, ``test_numerics.py``,
``test_state_dict.py``) and of the adjudicator's own test (``test_adjudicator.py``).

* :mod:`tests.fuzz.strategies` — hypothesis strategies for random well-formed objective trees
  (:func:`well_formed`) and for malformed ones (:func:`malformed`);
* :mod:`tests.fuzz.properties` — the checks applied to each drawn case;
* :mod:`tests.fuzz.stats` — outcome counting (``hypothesis.event`` + a JSON file under ``/tmp``).
"""
