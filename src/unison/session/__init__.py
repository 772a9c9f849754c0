"""The controller's side, one room per concern:

    api.py         Session and View: what users call
    checks.py      arguments checked before anything changes
    fncache.py     which functions the workers hold, and whether their copy is current
    router.py      which reply belongs to which request; who reads the channel
    unreported.py  errors nobody fetched yet
    resources.py   the channel, the collective segment and the launcher, owned and released
"""

from unison.session.api import Session, View

__all__ = ["Session", "View"]
