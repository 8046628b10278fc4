"""What `carry rebase` says about each patch: what porting took, the evidence for a drop (also
written into the entry's new message), and the report beside the new line."""

from __future__ import annotations

import datetime
import difflib
import re
import textwrap
from collections.abc import Sequence

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from ..git import Git
from ..series import APPLIED_UPSTREAM, Entry
from ..tables import markdown_row, text_table
from ..verify.plan import PASS, TestOutcome
from .journal import State
from .outcome import Outcome, PatchResult


def today() -> str:
    return datetime.datetime.now(datetime.UTC).date().isoformat()


# --- Drop-When ---

_SPECIFIER = re.compile(r"(===|==|!=|~=|>=|<=|>|<)\s*(\d+(?:\.\d+)*(?:(?:a|b|rc|\.post|\.dev)\d+)*)")


def drop_when_matches(entry: Entry, name: str, version: str) -> list[str]:
    """The entry's Drop-When conditions that admit ``version``: its version specifiers
    (``>= 0.5.23``) all contain it, or it names the release (``sglang 0.5.23``)."""
    new = Version(version)
    named = re.compile(rf"\b{re.escape(name)}\s+v?{re.escape(version)}(?![\w.]*\d)", re.IGNORECASE)
    hits = []
    for condition in entry.trailers.get("Drop-When", []):
        try:
            specifiers = [SpecifierSet(op + number) for op, number in _SPECIFIER.findall(condition)]
        except InvalidSpecifier:
            specifiers = []
        admitted = bool(specifiers) and all(new in spec for spec in specifiers)
        if admitted or named.search(condition):
            hits.append(condition)
    return hits


# --- the evidence in a dropped entry's message ---


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=72, break_long_words=False, break_on_hyphens=False)


def evidence_for_fixed(entry: Entry, name: str, old: str, new: str) -> str:
    return _wrap(
        f"Applied upstream in {name} {new}: the tests of this entry ({' '.join(entry.tests)}) pass on "
        f"the pristine {new} tree, so `carry rebase` recorded it without its diff when it rebased the "
        f"{old} line on {today()} (Upstream-Status on {old}: {entry.status_line})."
    )


def evidence_for_empty(entry: Entry, name: str, old: str, new: str, pristine: TestOutcome) -> str:
    tests = (
        f"its tests ({' '.join(entry.tests)}) {'pass' if pristine == PASS else f'give {pristine}'} there"
        if entry.tests
        else "it names no tests"
    )
    return _wrap(
        f"Applied upstream in {name} {new}: its diff is already in the pristine {new} tree (git am "
        f"--3way found nothing left to change) and {tests}; `carry rebase` recorded it without a diff "
        f"when it rebased the {old} line on {today()} (Upstream-Status on {old}: {entry.status_line})."
    )


def with_evidence(message: str, evidence: str) -> str:
    """``message`` with the evidence as a paragraph of its own, just before its trailers."""
    subject, _, body = message.partition("\n\n")
    paragraphs = [p for p in body.strip("\n").split("\n\n") if p.strip()]
    trailers = paragraphs.pop() if paragraphs else ""
    return "\n\n".join([subject.strip(), *paragraphs, evidence, trailers]) + "\n"


def with_applied_upstream_status(git: Git, message: str, evidence: str) -> str:
    """``message`` with the evidence before its trailers, and its Upstream-Status trailer (with
    any continuation lines) replaced by Applied-Upstream by `git interpret-trailers`; the other
    trailers, Test: among them, kept in their order."""
    replaced = git.out(
        "interpret-trailers", "--if-exists", "replace", "--where", "start",
        "--trailer", f"Upstream-Status: {APPLIED_UPSTREAM}",
        stdin=with_evidence(message, evidence),
    )  # fmt: skip
    return replaced + "\n"


# --- what porting took ---


def _changed_lines(diff: str) -> list[str]:
    lines = []
    in_diff = False
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            in_diff = True
        elif in_diff and line.startswith(("+", "-")) and not line.startswith(("+++ ", "--- ")):
            lines.append(line)
    return lines


def porting_change(old_patch: str, new_diff: str) -> str:
    """How far the ported diff is from the old patch, counted in changed (+/-) lines."""
    before, after = _changed_lines(old_patch), _changed_lines(new_diff)
    compared = list(difflib.ndiff(before, after))
    gone = sum(1 for line in compared if line.startswith("- "))
    new = sum(1 for line in compared if line.startswith("+ "))
    if gone == new == 0:
        return f"the same {len(before)} +/- lines as the old patch"
    return f"{gone} of the old patch's {len(before)} +/- lines replaced by {new} new ones"


# --- tables and the report ---


def render_patch_table(results: Sequence[PatchResult]) -> str:
    rows = [(r.filename, str(r.outcome or "-"), r.pristine, r.note or r.porting()) for r in results]
    return text_table(("patch", "outcome", "tests on pristine", "porting / note"), rows)


def render_report(
    state: State, new_names: Sequence[str], range_diff: str, verify_table: str, verified: bool
) -> str:
    name, old, new = state.name, state.old, state.new
    out = [
        f"# {name} {old} -> {new}",
        "",
        f"Written by `{state.command}` on {today()}. The {new} pin was {state.pin_source}.",
        "",
        "## Per patch",
        "",
        markdown_row(
            ("old patch", "new patch", "outcome", f"its tests on pristine {new}", "what porting took")
        ),
        markdown_row(("---",) * 5),
    ]
    for index, result in enumerate(state.results):
        new_name = new_names[index] if index < len(new_names) else "-"
        porting = result.porting() + (f" ({result.note})" if result.note else "")
        outcome = str(result.outcome or "-")
        out.append(markdown_row((result.filename, new_name, outcome, result.pristine, porting)))
    out += ["", "Outcomes: " + "; ".join(f"**{o}** {o.meaning}" for o in Outcome) + ".", ""]
    out += ["## Drops", ""]
    drops = [r for r in state.results if r.outcome is not None and r.outcome.dropped]
    for result in drops:
        why = (
            f"its tests pass on the pristine {new} tree"
            if result.outcome is Outcome.FIXED_UPSTREAM
            else f"its diff is already in {new} (its tests: {result.pristine} on pristine {new})"
        )
        out.append(f"- `{result.filename}` ({result.subject}): {why}; recorded Applied-Upstream, no diff.")
    kept = [r for r in state.results if r.pristine == PASS and r.outcome is not None and r.outcome.carried]
    for result in kept:
        out.append(
            f"- `{result.filename}`: its tests pass on the pristine {new} tree, but it was kept (--keep)."
        )
    if not drops and not kept:
        out.append(f"None: no entry's tests pass on the pristine {new} tree.")
    regressed = [r for r in state.results if r.outcome is Outcome.APPLIED_UPSTREAM and r.pristine != PASS]
    if regressed:
        out += ["", "**Upstream regressed?** These Applied-Upstream entries' tests do not pass on "
                f"pristine {new}:", ""]  # fmt: skip
        out += [f"- `{r.filename}`: {r.pristine}" for r in regressed]
    drop_when = [r for r in state.results if r.drop_when]
    out += ["", "## Drop-When conditions that admit " + new, ""]
    out += [f"- `{r.filename}` ({r.outcome}): {'; '.join(r.drop_when)}" for r in drop_when] or ["None."]
    out += ["", f"## git range-diff upstream/{old}..carry/{old} upstream/{new}..carry/{new}", ""]
    out += ["```text", range_diff.rstrip("\n") or "(empty)", "```", "", "## Verify", ""]
    if verified:
        out += ["```text", verify_table, "```"]
    else:
        out.append("Not run: the replay did not finish.")
    return "\n".join(out) + "\n"
