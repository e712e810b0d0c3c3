from maskcli.commands import main

main()
