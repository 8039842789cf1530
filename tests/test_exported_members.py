"""`blockdiff.__all__` is exactly the public API."""

import blockdiff


def test_all_is_exactly_the_public_names():
    assert sorted(blockdiff.__all__) == sorted(
        [
            "__version__",
            "diff",
            "run",
            "Options",
            "RandomTokens",
            "Report",
            "Tolerance",
            "HookMap",
            "Layout",
            "resolve",
            "trained_looking_",
            "assert_no_divergence",
            "DivergenceError",
            "assert_batch_invariant",
            "BlockdiffError",
            "DumpError",
            "HookMapError",
            "InputError",
            "OptionsError",
            "ModelRunError",
            "ModelSpecError",
            "PairingError",
            "ShapeMismatchError",
        ]
    )
    for name in blockdiff.__all__:
        assert hasattr(blockdiff, name), name
