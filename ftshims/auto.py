"""``import ftshims.auto`` applies the default shims: the one-line form of ``ftshims.apply()``.

Importing this module *does* patch (that is its only purpose); ``import ftshims``
alone never does.
"""

import ftshims

report = ftshims.apply()
