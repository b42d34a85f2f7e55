"""Component styles of a panel as a dict, computed once and kept until the CSS or theme changes.

``get_component_rich_style`` costs about 0.3 ms a name: over a dozen names, at every redraw,
that was most of what drawing a panel cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from rich.style import Style
from textual.geometry import Size
from textual.reactive import reactive
from textual.widget import Widget


class StyledWidget(Widget):
    """A widget whose ``COMPONENT_CLASSES`` styles come from :meth:`component_styles`."""

    #: True: styles without a background of their own (what is under them shows through)
    PARTIAL_STYLES: ClassVar[bool] = False
    _panel_styles: dict[str, Style] | None = None

    def component_styles(self) -> dict[str, Style]:
        """``{"value": Style, ...}`` for ``COMPONENT_CLASSES`` named ``panel--value``."""
        if self._panel_styles is None:
            self._panel_styles = {
                name.split("--", 1)[1]: self.get_component_rich_style(name, partial=self.PARTIAL_STYLES)
                for name in self.COMPONENT_CLASSES
            }
        return self._panel_styles

    def notify_style_update(self) -> None:
        self._panel_styles = None
        super().notify_style_update()


class LinesPanel(StyledWidget):
    """A panel drawn by ``VIEW(info, styles)``, a renderable with ``lines(width)``; its height follows them."""

    VIEW: ClassVar[Callable[[Any, dict[str, Style]], Any]]
    info: reactive[Any] = reactive(None)
    _lines = 0

    def watch_info(self) -> None:
        # a new layout only when the number of lines changed (at the width it really has: before the first
        # layout there is none yet, and a count taken at a guessed width could hide a needed relayout)
        width = self.content_size.width
        if not width:
            self._lines = -1
            self.refresh(layout=True)
            return
        lines = len(self._view().lines(width))
        if lines != self._lines:
            self._lines = lines
            self.refresh(layout=True)

    def _view(self) -> Any:
        return self.VIEW(self.info, self.component_styles())

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._view().lines(width))

    def render(self) -> Any:
        return self._view()
