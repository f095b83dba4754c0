"""The pytest plugin, driven through pytest's own pytester in a subprocess."""

pytest_plugins = ["pytester"]

SPEC = """
source_patch: 1
name: plug
patches:
  - id: p
    module: spfix.basic
    target: add
    edits:
      - {at: return, code: "result = 'patched'"}
"""


def test_session_option_patches_before_conftest(pytester, write_spec):
    spec = write_spec(SPEC)
    pytester.makeconftest("import spfix.basic\n")  # conftest imports the target early
    pytester.makepyfile("""
        import spfix.basic
        def test_it():
            assert spfix.basic.add(1, 2) == 'patched'
        """)
    result = pytester.runpytest_subprocess("--source-patch", str(spec))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"source-patch: plug ({spec})"])


def test_without_the_option_nothing_is_patched(pytester):
    pytester.makepyfile("""
        import spfix.basic
        def test_it():
            assert spfix.basic.add(1, 2) == 3
        """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_bad_spec_is_a_usage_error(pytester, write_spec):
    spec = write_spec(SPEC.replace("id: p", "id: p\n    bogus: 1"))
    result = pytester.runpytest_subprocess("--source-patch", str(spec))
    assert result.ret == 4  # pytest's usage error
    result.stderr.fnmatch_lines([f"*--source-patch: {spec}:*unknown key 'bogus'*"])


def test_fixture_gives_a_fresh_patched_copy(pytester, write_spec):
    spec = write_spec(SPEC)
    pytester.makepyfile(f"""
        import spfix.basic
        def test_it(source_patch_import):
            copy = source_patch_import("spfix.basic", {str(spec)!r})
            assert copy.add(1, 2) == 'patched'
            assert spfix.basic.add(1, 2) == 3
        """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
