"""Modal screens: the quit question and the key help."""

from __future__ import annotations

from collections.abc import Iterable

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

STOP, DETACH = "stop", "detach"


class QuitScreen(ModalScreen[str | None]):
    """Ask what to do with a running job; dismisses with ``"stop"``, ``"detach"`` or None."""

    BINDINGS = [
        Binding("s", "choose('stop')", "Stop training"),
        Binding("d", "choose('detach')", "Detach"),
        Binding("escape", "choose(None)", "Cancel"),
    ]

    def __init__(self, can_stop: bool, pid: str = "", launched: bool = True) -> None:
        super().__init__()
        self.can_stop = can_stop
        self.pid = pid
        self.launched = launched

    def compose(self) -> ComposeResult:
        text = Text("The training job is still running.\n\n", style="bold")
        if self.can_stop and self.launched:
            text.append("[s]", "bold").append("   stop training (SIGINT to the job)\n")
        elif self.can_stop:  # attached: the job's own agent signals itself
            text.append("[s]", "bold").append("   stop training: its agent sends\n")
            text.append(f"      SIGINT to pid {self.pid or '?'}, like Ctrl-C\n")
        else:
            text.append("not connected to the job: stop it with ")
            text.append(f"kill -INT {self.pid}\n" if self.pid else "kill -INT PID\n")
        text.append("[d]", "bold").append("   detach and leave it running\n")
        text.append("[esc]", "bold").append(" cancel")
        with Vertical(id="dialog"):
            yield Static(text)
        yield Footer()  # this dialog's keys: the dashboard's own footer under it named keys that do nothing here

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "choose" and parameters == (STOP,) and not self.can_stop:
            return False
        return True

    def action_choose(self, choice: str | None) -> None:
        self.dismiss(choice)


class HelpScreen(ModalScreen[None]):
    """The list of keys."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("question_mark", "close", "Close", show=False),
        Binding("q", "close", "Close", show=False),
    ]

    def __init__(self, keys: Iterable[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = list(keys)

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for key, description in self.keys:
            table.add_row(key, description)
        with Vertical(id="dialog"):
            yield Static(Text("Keys", style="bold"))
            yield Static(table)
            yield Static("esc, ? or q closes this help", id="hint")

    def action_close(self) -> None:
        self.dismiss(None)
