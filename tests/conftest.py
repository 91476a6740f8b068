"""The suite's layout follows the package's folders (docs/layout.md); the shared helpers ``_dist`` and ``_models``
sit here, and pytest puts this folder on ``sys.path`` because this file is in it."""
