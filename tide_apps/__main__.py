from tide_apps.cli import main

raise SystemExit(main())
