@echo off
rem strata-console.cmd: runs strata in a Windows console window (docs\OPERATIONS.md, "Windows").
rem
rem It uses the virtual environment in the repository root, one folder above this script:
rem     py -3.11 -m venv .venv
rem     .venv\Scripts\python -m pip install -e .
rem
rem   strata-console.cmd                                  runs "strata serve" with its defaults
rem   strata-console.cmd --config C:\strata\config.json   options alone are options of "serve"
rem   strata-console.cmd pull gemma3-270m                 a command first runs that command
rem
rem Ctrl+C stops the server cleanly: it stops admitting requests (new ones get 503), finishes or
rem cancels the requests in flight within --shutdown-timeout-s, then exits. If cmd then asks
rem "Terminate batch job (Y/N)?", either answer is fine: the server has already stopped.
setlocal
rem %~dp0 is this script's folder with a trailing backslash, so the launcher works from any directory.
set "STRATA_EXE=%~dp0..\.venv\Scripts\strata.exe"
if not exist "%STRATA_EXE%" (
    echo strata-console: "%STRATA_EXE%" not found. 1>&2
    echo Create it in the repository root: py -3.11 -m venv .venv, then .venv\Scripts\python -m pip install -e . 1>&2
    exit /b 1
)
set "STRATA_FIRST=%~1"
if not defined STRATA_FIRST goto serve
if "%STRATA_FIRST:~0,1%"=="-" goto serve
"%STRATA_EXE%" %*
exit /b %ERRORLEVEL%

:serve
"%STRATA_EXE%" serve %*
exit /b %ERRORLEVEL%
