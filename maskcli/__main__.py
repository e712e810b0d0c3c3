from maskcli.cli import main

main()
