"""Run model-written SQL against a real SQLite database without letting it change or escape anything.

Layers, each enough on its own for writes, together also for the rest:

- the file is opened read-only (``file:...?mode=ro``) and ``PRAGMA query_only``
  is set, so no statement can write;
- an authorizer admits only what a SELECT needs (reading tables, calling
  functions, recursive CTEs) and refuses everything else at prepare time:
  ATTACH, PRAGMA, DDL, DML, transactions;
- Python's ``execute`` prepares exactly one statement (``SELECT 1; DROP ...``
  is refused before anything runs);
- a progress handler interrupts a statement past its deadline (an endless
  recursive CTE), rows past ``max_rows`` are refused, and SQLite's length limit
  caps any single string or blob (``zeroblob(1e9)``);
- SQLite's column limit caps a result row at ``max_columns`` columns (raised to
  twice the widest table of the database, so its own ``SELECT *`` joins run),
  rows are fetched one at a time, and a result past ``max_result_bytes`` or
  past the deadline while fetching is refused: ``SELECT zeroblob(999999), ...``
  a thousand times over no longer builds gigabytes after its deadline.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

# Virtual-machine instructions between deadline checks: fine enough to stop
# within milliseconds, coarse enough to cost nothing measurable.
_PROGRESS_INTERVAL = 1000

_ALLOWED_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)

Row = tuple


class SQLExecutionError(Exception):
    """The statement did not produce a result (syntax error, unknown column, ...)."""


class SQLRefused(SQLExecutionError):
    """The statement is not one read-only query: several statements, a write, ATTACH, PRAGMA, ..."""


class SQLTimeout(SQLExecutionError):
    """The statement ran past its deadline and was interrupted."""


class SQLResultTooLarge(SQLExecutionError):
    """The statement returned more rows, columns or bytes than allowed."""


@dataclass(frozen=True)
class ExecutionLimits:
    """Bounds on one statement: wall-clock seconds, result rows, bytes in any one value, result columns, result bytes.

    ``max_columns`` is a floor: a database with a wider table gets twice its
    width, so queries over its own tables keep working (BIRD has a 70-column
    table). One row then holds at most that many values of ``max_value_bytes``.
    ``max_result_bytes`` counts the length of every string and blob and 8 bytes
    for any other value, over all rows fetched.
    """

    timeout_s: float = 2.0
    max_rows: int = 10_000
    max_value_bytes: int = 1_000_000
    max_columns: int = 64
    max_result_bytes: int = 32_000_000

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if self.max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be >= 1, got {self.max_value_bytes}")
        if self.max_columns < 1:
            raise ValueError(f"max_columns must be >= 1, got {self.max_columns}")
        if self.max_result_bytes < 1:
            raise ValueError(f"max_result_bytes must be >= 1, got {self.max_result_bytes}")


class _Authorizer:
    """Admits the actions of a SELECT and remembers whether it denied anything.

    SQLite reports some denials as a generic SQLITE_ERROR, so the memory, not
    the error code, tells a refusal from an ordinary error.
    """

    def __init__(self):
        self.denied = False

    def __call__(self, action: int, *_details) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        self.denied = True
        return sqlite3.SQLITE_DENY


def _decode_text(value: bytes) -> str:
    return value.decode("utf-8", errors="replace")


def _widest_table(connection: sqlite3.Connection) -> int:
    """Columns of the widest table or view; 0 when there is none or the schema cannot be read."""
    try:
        (widest,) = connection.execute(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM sqlite_master AS m, pragma_table_info(m.name) AS c"
            " WHERE m.type IN ('table', 'view') GROUP BY m.name)"
        ).fetchone()
    except sqlite3.Error:
        return 0
    return widest or 0


def _open_readonly(
    db_path: str | Path,
    max_value_bytes: int = ExecutionLimits.max_value_bytes,
    max_columns: int = ExecutionLimits.max_columns,
) -> tuple[sqlite3.Connection, _Authorizer]:
    """A connection to ``db_path`` that can only read, and its authorizer; FileNotFoundError if there is no file."""
    path = Path(db_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"SQLite database {str(path)!r} does not exist")
    # mode=ro also keeps SQLite from creating a missing file.
    connection = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    connection.execute("PRAGMA query_only = ON")
    connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
    # The limit also applies to table definitions when SQLite parses the
    # schema, so it must admit the database's own widest table; measured
    # before the authorizer, which refuses the PRAGMA function.
    connection.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, max(max_columns, 2 * _widest_table(connection)))
    # TEXT that is not valid UTF-8 (a CAST(x'ff' AS TEXT), a badly imported
    # database) would otherwise fail the fetch with "Could not decode to UTF-8";
    # both the prediction and the gold query read it with U+FFFD instead.
    connection.text_factory = _decode_text
    authorizer = _Authorizer()
    connection.set_authorizer(authorizer)
    return connection, authorizer


def execute_readonly(db_path: str | Path, sql: str, limits: ExecutionLimits = ExecutionLimits()) -> list[Row]:
    """All result rows of one read-only statement ``sql`` on ``db_path``, within ``limits``.

    Raises SQLRefused, SQLTimeout, SQLResultTooLarge or SQLExecutionError; the
    database file is never modified.
    """
    connection, authorizer = _open_readonly(db_path, limits.max_value_bytes, limits.max_columns)
    deadline = time.monotonic() + limits.timeout_s
    # A true return makes SQLite abandon the statement with SQLITE_INTERRUPT.
    connection.set_progress_handler(lambda: time.monotonic() > deadline, _PROGRESS_INTERVAL)
    try:
        rows = _fetch_within_limits(connection.execute(sql), limits, deadline)
    except sqlite3.ProgrammingError as error:
        raise SQLRefused(f"only a single statement may run: {error}") from error
    except sqlite3.Error as error:
        # Errors raised by Python's module rather than by SQLite (a failed
        # conversion, an InterfaceError) carry no sqlite_errorname.
        errorname = getattr(error, "sqlite_errorname", None)
        if "too many columns in result set" in str(error):
            raise SQLResultTooLarge(f"statement returns more columns than allowed: {error}") from error
        if errorname == "SQLITE_INTERRUPT":
            raise SQLTimeout(f"statement exceeded {limits.timeout_s}s and was interrupted") from error
        if authorizer.denied or errorname == "SQLITE_READONLY":
            raise SQLRefused(f"statement is not a read-only query: {error}") from error
        raise SQLExecutionError(str(error)) from error
    finally:
        connection.close()
    return rows


def _fetch_within_limits(cursor: sqlite3.Cursor, limits: ExecutionLimits, deadline: float) -> list[Row]:
    """The cursor's rows, one at a time, refusing past ``max_rows``, ``max_result_bytes`` or the deadline.

    Turning a row into Python values (blobs, long strings) runs outside
    SQLite's virtual machine, where the progress handler cannot stop it, so
    the deadline is checked here too.
    """
    rows = []
    total_bytes = 0
    for row in cursor:
        rows.append(row)
        if len(rows) > limits.max_rows:
            raise SQLResultTooLarge(f"statement returned more than {limits.max_rows} rows")
        total_bytes += sum(len(value) if isinstance(value, (str, bytes)) else 8 for value in row)
        if total_bytes > limits.max_result_bytes:
            raise SQLResultTooLarge(f"statement returned more than {limits.max_result_bytes} bytes")
        if time.monotonic() > deadline:
            raise SQLTimeout(f"statement exceeded {limits.timeout_s}s while its rows were fetched")
    return rows


def table_definitions(db_path: str | Path) -> list[str]:
    """The ``CREATE TABLE`` statements of ``db_path``, in schema order."""
    connection, _ = _open_readonly(db_path)
    try:
        # sqlite_master is readable under the authorizer: it is a table read.
        rows = connection.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
    finally:
        connection.close()
    return [sql for (sql,) in rows]
