"""Seed objectives of the papers, built from the same terms a user would write.

* ``opteq(form="conjugate")``: OptEq Theorem 1 (TPAMI Eq. 5-6), ``φ = ψ* - ½||·||²``,
  ``ψ = (1/μ)Σσ̃(Wz + Ux + b)``;
* ``opteq(form="canonical")``: reformulated OptEq (docs/theory.md §3 row 1),
  ``Σf_σ(z) + ½||z||² - <Ux+b, z> - ½||Wz||²``;
* ``deep_opteq``: deep OptEq, TPAMI §5 (Lemma 3 / Thm 2 / Cor 1),
  ``f_l = αW_lᵀσ(W_l z + U_l x + b_l) + (1-α)z``;
* ``geq``: GEQ/KerDEQ (docs/theory.md §3 rows 2-3), Gaussian-kernel similarity, whole or
  patch-split; ``conv_geq``: GEQ as its paper builds it, independent patch- and channel-split
  branches at several input scales (docs/theory.md §3.2);
* ``mopteq``: MOptEq with HH&D fusion on the signed branch states ``z̃_i = W_iᵀy_i``
  (docs/theory.md §3 row 4), ``− ½ΣH(z̃) + (λ/2)ΣD(z̃)``; ``conv_mopteq``: its multi-branch,
  multi-scale convolutional form on signals or images (``fusion="none"``: the POptEq baseline;
  ``branch_inputs=True``: one input per branch, for the perturbation-enhanced layer
  :func:`lowering.perturbation_enhanced`).
"""

from .geq import conv_geq, geq, patch_weight
from .mon import mon
from .mopteq import conv_mopteq, mopteq
from .opteq import deep_opteq, opteq
from .weights import conv_spec, conv_weight, injection, resample, spectral_weight, torch_seed

__all__ = ["conv_geq", "conv_mopteq", "conv_spec", "conv_weight", "deep_opteq", "geq",
           "injection", "mon", "mopteq", "opteq", "patch_weight", "resample", "spectral_weight",
           "torch_seed"]
